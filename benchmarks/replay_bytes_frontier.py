"""Attention lost against bytes moved, on the replay twin (``kvgym/KVCacheReplay-v1``): the trade-off a learned
controller has to beat (issue 39: moving bytes costs).

Every policy plays every recorded episode at each budget with a host tier; per policy the mean over episodes of
the attention share lost off the device (summed over an episode's decision points, divided by their number) and
of the MB moved between tiers per decision point. Policies: the shipped ranker with the hysteresis ``stay`` swept
(the hand-set knob that trades bytes for attention), heuristic feature rankings, and two oracles that read the
recorded future: ``oracle`` (greedy: the blocks the next interval attends most, whatever it moves) and
``oracle, stay S`` (the same with the ranker's hysteresis on the future's scores). Writes ``--json`` and a plot.

    python -m benchmarks.replay_bytes_frontier --episodes data/replay_heldout --json results/replay_frontier/frontier.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.replay_fidelity_v1 import column, rank_action, ranker, with_stay


def play(env, score, options) -> dict:
    observation, _ = env.reset(options=options)
    lost, mb, steps, done = 0.0, 0.0, 0, False
    while not done:
        observation, _, done, _, info = env.step(rank_action(score(env, observation), observation["mask"]))
        lost, mb, steps = lost + info["lost_mass"], mb + info["mb_moved"], steps + 1
    return {"lost": lost / steps, "mb": mb / steps, "steps": steps}


def future_scores(env, observation) -> np.ndarray:
    future = env._episode["future"][env._point]
    keep = np.zeros(observation["mask"].shape)
    keep[:, : future.shape[1]] = future
    return keep


def policies(stays) -> dict:
    table = {}
    for stay in stays:
        table[f"ranker, stay {stay:g}"] = (lambda f: lambda env, obs: f(obs["blocks"], obs["mask"]))(
            ranker("policies/ranker_smollm2.pt", stay))
    for name, feature in (("tova", "last_query_mean_rank"), ("keydiff", "key_distinct_rank"), ("knorm", "key_norm_rank"),
                          ("quest bound", "page_bound_max_rank")):
        table[name] = (lambda f: lambda env, obs: f(obs["blocks"]))(column(feature))
    for stay in (0.0, 2.0):
        table[f"oracle, stay {stay:g}"] = (lambda s: lambda env, obs: with_stay(future_scores(env, obs), obs["blocks"], obs["mask"], s))(stay)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=Path, required=True, help="a folder of recorded episodes")
    parser.add_argument("--budgets", default="0.125,0.25")
    parser.add_argument("--stays", default="0,0.5,1,2,4,8")
    parser.add_argument("--host-blocks", type=int, default=512)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    from kvgym.envs.kvcache_replay import KVCacheReplayEnv

    env = KVCacheReplayEnv(str(args.episodes), host_blocks=args.host_blocks)
    table = policies([float(s) for s in args.stays.split(",")])
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = []
    for budget in budgets:
        for name, score in table.items():
            runs = [play(env, score, {"episode": i, "budget": budget}) for i in range(len(env.episodes))]
            rows.append({"budget": budget, "policy": name, "lost": float(np.mean([r["lost"] for r in runs])),
                         "mb_per_step": float(np.mean([r["mb"] for r in runs])), "episodes": len(runs)})
            print(json.dumps(rows[-1]), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"episodes": str(args.episodes), "host_blocks": args.host_blocks, "rows": rows},
                                    indent=1))
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5 * len(budgets), 4.2), dpi=100)
    FigureCanvasAgg(figure)
    for i, budget in enumerate(budgets):
        ax = figure.add_subplot(1, len(budgets), i + 1)
        for row in (r for r in rows if r["budget"] == budget):
            style = "o" if row["policy"].startswith("ranker") else ("*" if row["policy"].startswith("oracle") else "s")
            ax.plot(row["mb_per_step"], row["lost"], style)
            ax.annotate(row["policy"], (row["mb_per_step"], row["lost"]), fontsize=6)
        ax.set_title(f"budget {budget:g}, host {args.host_blocks} blocks", fontsize=10)
        ax.set_xlabel("MB moved between tiers per decision point")
        ax.set_ylabel("attention share lost off the device (mean per step)")
        ax.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.json.with_suffix(".png"), bbox_inches="tight")


if __name__ == "__main__":
    main()
