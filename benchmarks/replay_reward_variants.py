"""Would another replay reward rank policies as live decoding does (issue 37's fidelity must-show)?

``benchmarks/replay_fidelity_v1.py`` played 11 policies on 6 recorded episodes, live and in the replay twin, and
found a mean Spearman of 0.05 between the replay return (the attention lost off the device, every decision point,
mean over layers) and the live return. This script replays the same policies on the same recorded episodes, keeps
every decision point's per-layer lost share (and, at the answer's decision points, the future attention itself)
and scores other replay returns against the live returns stored in that run's JSON: which decision points count
(all, the answer's: question and decode, the prefill's), how layers are pooled (mean, max, top-5, median, p90,
-log of the kept share), and, at the answer's points, the lost share of the context blocks only and of the 3 most
attended blocks. No live run is repeated, so the variants are compared on the very episodes they are scored on:
an upper bound of what reweighting alone can do, not a held-out result.

    python -m benchmarks.replay_reward_variants --live results/replay_v1/fidelity_1k_b0.25.json \
        --json results/replay_v1/reward_variants_1k_b0.25.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from benchmarks.replay_fidelity_v1 import action_of, policies
from eval.ranking_fidelity import spearman

POOLS = {"mean": np.mean, "max": np.max, "top5": lambda s: np.mean(np.sort(s)[-5:]), "median": np.median,
         "p90": lambda s: np.quantile(s, 0.9), "neg_log_kept": lambda s: -np.mean(np.log(np.maximum(1 - s, 1e-3)))}
PHASES = {"all": ("prefill", "question", "decode"), "answer": ("question", "decode"), "prefill": ("prefill",)}


def replay_steps(replay, score, index: int, budget: float) -> list[dict]:
    """One replayed episode: per decision point its phase, each layer's lost share, and (answer points) the future
    attention and the tiers it met."""
    from kvgym.envs.kvcache_replay import DEVICE, NOT_YET

    observation, _ = replay.reset(options={"episode": index, "budget": budget})
    steps, done = [], False
    while not done:
        point = replay._point
        episode = replay._episode
        phase, future = episode["phases"][point], episode["future"][point]
        observation, _, done, _, _ = replay.step(action_of(score, observation))
        n = future.shape[1]
        tier = replay._tier[:, :n]
        off = (tier != DEVICE) & (tier != NOT_YET)
        total = future.sum(axis=1)
        lost = np.where(total > 0, np.where(off, future, 0).sum(axis=1) / np.where(total > 0, total, 1), 0)
        steps.append({"phase": phase, "lost": lost, "future": future if phase != "prefill" else None,
                      "off": off if phase != "prefill" else None})
    return steps


def answer_lost(step: dict, context_blocks: int, mode: str) -> float:
    """At an answer point: the lost share of the future attention on context blocks (``context``) or the share of the
    3 most attended context blocks that are off the device (``top3``), mean over layers; the sink excluded."""
    future = step["future"].copy()
    future[:, :1] = 0
    future[:, max(context_blocks - 1, 1):] = 0
    if mode == "top3":
        top = np.argsort(-future, axis=1)[:, :3]
        return float(np.mean(np.take_along_axis(step["off"], top, axis=1)))
    total = future.sum(axis=1)
    lost = np.where(step["off"], future, 0).sum(axis=1)
    return float(np.mean(np.where(total > 0, lost / np.where(total > 0, total, 1), 0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=Path, required=True, help="a replay_fidelity_v1 JSON (its rows: live returns)")
    parser.add_argument("--data", type=Path, default=None, help="its recorded episodes (default: data/replay_v1_SEED)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    from cache.models import load_model
    from kvgym.envs.kvcache_replay import KVCacheReplayEnv, load_episodes, record_episodes

    live = json.loads(args.live.read_text())
    data = args.data or Path(f"data/replay_v1_{live['seed']}")
    loaded = load_model("smollm2-135m")
    paths = record_episodes(loaded.model, loaded.tokenizer, [live["task"]], [live["length"]],
                            len(live["episodes"]), live["seed"], data, protocol="streaming", chat=False)
    episodes = load_episodes(paths)
    replay = KVCacheReplayEnv(episodes, host_blocks=live["host_blocks"],
                              max_tokens=int(1.25 * max(e["total_tokens"] for e in episodes)) + 256)
    table = policies()
    played = {(index, name): replay_steps(replay, score, index, live["budget"])
              for index in range(len(episodes)) for name, score in table.items()}
    context_blocks = [e["context_tokens"] // e["block_size"] for e in episodes]
    returns = {}
    for phase_name, phases in PHASES.items():
        for pool_name, pool in POOLS.items():
            returns[f"{phase_name} {pool_name}"] = {
                key: -sum(pool(s["lost"]) for s in steps if s["phase"] in phases) for key, steps in played.items()}
    for mode in ("context", "top3"):
        returns[f"answer {mode}"] = {
            key: -sum(answer_lost(s, context_blocks[key[0]], mode) for s in steps if s["phase"] != "prefill")
            for key, steps in played.items()}
    rows = live["rows"]
    answered = [e["episode"] for e in live["episodes"] if e["some_policy_correct"]]
    variants = []
    for name, values in returns.items():
        rhos = []
        for index in answered:
            mine = [r for r in rows if r["episode"] == index]
            rhos.append(spearman([values[index, r["policy"]] for r in mine], [r["live_return"] for r in mine]))
        finite = [rho for rho in rhos if not math.isnan(rho)]
        variants.append({"variant": name, "spearman_per_episode": [round(rho, 3) for rho in rhos],
                         "mean": float(np.mean(finite)) if finite else math.nan})
    variants.sort(key=lambda v: -v["mean"])
    report = {"live": str(args.live), "episodes_answered": answered, "variants": variants}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    for v in variants:
        print(f"{v['variant']:22s} mean {v['mean']:+.3f}  {v['spearman_per_episode']}")


if __name__ == "__main__":
    main()
