"""Does ``kvgym/KVCacheReplay-v1`` rank policies as the live ``KVCache-v1`` does (issue 37's must-show)?

For each of ``--episodes`` samples (recorded once, full cache, streaming), every policy of ``POLICIES`` (a keep
score per block from the observation's features alone, so the same function runs in both envs) plays one episode
in the replay and one live, at the same budget and host tier. Per episode: Spearman between the replay return
(minus the attention lost off the device) and the live return (minus the KL to the full cache on the answer
positions, plus the task score), over the policies. Also the replay's steps per second over every recorded
episode (random actions). Writes ``--json``; run from the repository root, alone on the machine for the speed.

    python -m benchmarks.replay_fidelity_v1 --episodes 6 --json results/replay_fidelity_v1.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from cache.ranking import RANK_FEATURES
from eval.ranking_fidelity import spearman

TIER_DEVICE = RANK_FEATURES.index("tier_device")


def column(name: str, sign: float = 1.0):
    index = RANK_FEATURES.index(name)
    return lambda blocks: sign * blocks[..., index]


def with_stay(keep: np.ndarray, blocks: np.ndarray, mask: np.ndarray, stay: float) -> np.ndarray:
    """A hysteresis like ``keep_top``'s: resident blocks' scores lifted by ``stay`` standard deviations of the
    layer's scores, taken here over every block of the mask (``keep_top`` takes them over the unpinned candidates:
    nearly the same margin, not the same to the digit)."""
    if not stay:
        return keep
    valid = mask > 0
    count = np.maximum(valid.sum(axis=1, keepdims=True), 1)
    mean = np.where(valid, keep, 0).sum(axis=1, keepdims=True) / count
    spread = np.sqrt(np.where(valid, (keep - mean) ** 2, 0).sum(axis=1, keepdims=True) / count)
    return keep + stay * spread * blocks[..., TIER_DEVICE]


def ranker(path: str, stay: float = 0.0):
    """The ranker file's scores, with ``keep_top``'s hysteresis added to the resident blocks' scores."""
    from agents.ranker.model import load_ranker

    scorer = load_ranker(path)[0].inference()
    return lambda blocks, mask: with_stay(scorer(blocks)[0].astype(np.float64), blocks, mask, stay)


def policies(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    fixed = rng.uniform(-1, 1, (64, 4096))
    plain = {
        "tova (last query)": column("last_query_mean_rank"),
        "window max": column("last_max_rank"),
        "observed": column("observed_mean_rank"),
        "knorm": column("key_norm_rank"),
        "keydiff": column("key_distinct_rank"),
        "quest bound": column("page_bound_max_rank"),
        "newest": column("distance_from_end", -1.0),
        "oldest": column("distance_from_end"),
        "random": lambda blocks: fixed[: blocks.shape[0], : blocks.shape[1]],
    }
    table = {name: (lambda rule: lambda blocks, mask: rule(blocks))(f) for name, f in plain.items()}
    table["ranker"] = ranker("policies/ranker_smollm2.pt")
    table["ranker, stay 2"] = ranker("policies/ranker_smollm2.pt", stay=2.0)
    return table


def rank_action(keep: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The envs' action for keep scores ``[L, N]``: each block's rank in its layer mapped into [-1, 1] (the same
    top-b as the scores, whatever their scale; blocks off the mask last), merge logits -1 (never merge)."""
    keep = np.where(mask > 0, keep, -1e30)
    action = np.full((*keep.shape, 2), -1.0, np.float32)
    order = np.argsort(np.argsort(keep, axis=1, kind="stable"), axis=1, kind="stable")
    action[..., 0] = (order / max(keep.shape[1] - 1, 1)) * 2 - 1
    return action


def action_of(score, observation) -> np.ndarray:
    return rank_action(score(observation["blocks"], observation["mask"]), observation["mask"])


def play(env, score, options) -> dict:
    observation, _ = env.reset(options=options)
    total, done, info, steps = 0.0, False, {}, 0
    while not done:
        observation, reward, done, _, info = env.step(action_of(score, observation))
        total += reward
        steps += 1
    return {"return": total, "steps": steps, "score": info.get("score"), "kl_positions": info.get("kl_positions")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=6)
    parser.add_argument("--task", default="families_train")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=401, help="kvgym eval's --seed of the recorded samples")
    parser.add_argument("--budget", type=float, default=0.125)
    parser.add_argument("--host-blocks", type=int, default=512)
    parser.add_argument("--data", type=Path, default=Path("data/replay_v1"))
    parser.add_argument("--speed-steps", type=int, default=5000)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    from cache.models import load_model
    from kvgym.envs.kvcache import KVCacheEnv
    from kvgym.envs.kvcache_replay import KVCacheReplayEnv, load_episodes, record_episodes

    loaded = load_model("smollm2-135m")
    paths = record_episodes(loaded.model, loaded.tokenizer, [args.task], [args.length], args.episodes, args.seed,
                            args.data, protocol="streaming", chat=False)
    episodes = load_episodes(paths)
    live = KVCacheEnv(loaded.model, loaded.tokenizer, tasks=(args.task,), lengths=(args.length,),
                      protocol="streaming", host_blocks=args.host_blocks, chat=False)
    replay = KVCacheReplayEnv(episodes, host_blocks=args.host_blocks, max_tokens=live.max_tokens)
    table = policies()
    rows = []
    for index, episode in enumerate(episodes):
        for name, score in table.items():
            start = time.perf_counter()
            replayed = play(replay, score, {"episode": index, "budget": args.budget})
            lived = play(live, score, {"task": args.task, "length": args.length, "budget": args.budget,  # the same sample
                                       "sample_seed": int(episode["sample_seed"]), "index": int(episode["index"])})
            rows.append({"episode": index, "policy": name, "replay_return": replayed["return"],
                         "live_return": lived["return"], "live_score": lived["score"], "replay_steps": replayed["steps"],
                         "live_steps": lived["steps"], "seconds": time.perf_counter() - start})
            print(json.dumps(rows[-1]), flush=True)
    per_episode = []
    for index in range(len(episodes)):
        mine = [r for r in rows if r["episode"] == index]
        rho = spearman([r["replay_return"] for r in mine], [r["live_return"] for r in mine])
        per_episode.append({"episode": index, "spearman": rho,
                            "some_policy_correct": any((r["live_score"] or 0) > 0 for r in mine)})
    answered = [e["spearman"] for e in per_episode if e["some_policy_correct"] and not math.isnan(e["spearman"])]
    rng = np.random.default_rng(0)
    replay.reset(seed=0)
    start, done_steps = time.perf_counter(), 0
    while done_steps < args.speed_steps:
        _, _, done, _, _ = replay.step(rng.uniform(-1, 1, replay.action_space.shape).astype(np.float32))
        done_steps += 1
        if done:
            replay.reset()
    speed = done_steps / (time.perf_counter() - start)
    report = {"task": args.task, "length": args.length, "seed": args.seed, "budget": args.budget,
              "host_blocks": args.host_blocks, "policies": list(table), "episodes": per_episode,
              "mean_spearman_answered": float(np.mean(answered)) if answered else math.nan,
              "min_spearman_answered": float(np.min(answered)) if answered else math.nan,
              "episodes_answered": len(answered), "replay_steps_per_s": speed, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
