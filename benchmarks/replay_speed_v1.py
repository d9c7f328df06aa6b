"""Steps per second of the replay twin ``kvgym/KVCacheReplay-v1`` over a recorded trace set (issue 37: >= 2,000).

Records ``--episodes`` full-cache streaming runs per length (kept in ``--data``: a rerun reuses them), then steps
random actions through every episode, at a random budget each, for ``--steps`` steps, resetting as episodes end;
the time excludes the recording and the env's one-time preparation. Run it alone on the machine.

    python -m benchmarks.replay_speed_v1 --lengths 1024,2048 --json results/replay_v1/speed.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--episodes", type=int, default=6)
    parser.add_argument("--task", default="families_train")
    parser.add_argument("--seed", type=int, default=401)
    parser.add_argument("--host-blocks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--data", type=Path, default=Path("data/replay_speed"))
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from cache.models import load_model
    from kvgym.envs.kvcache_replay import KVCacheReplayEnv, load_episodes, record_episodes

    loaded = load_model("smollm2-135m")
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        paths = record_episodes(loaded.model, loaded.tokenizer, [args.task], [length], args.episodes, args.seed,
                                args.data, protocol="streaming", chat=False, log=lambda *_: None)
        start = time.perf_counter()
        replay = KVCacheReplayEnv(load_episodes(paths), host_blocks=args.host_blocks)
        prepare_s = time.perf_counter() - start
        rng = np.random.default_rng(0)
        actions = [rng.uniform(-1, 1, replay.action_space.shape).astype(np.float32) for _ in range(16)]
        replay.reset(seed=0)
        start = time.perf_counter()
        for step in range(args.steps):
            _, _, done, _, _ = replay.step(actions[step % len(actions)])
            if done:
                replay.reset()
        seconds = time.perf_counter() - start
        rows.append({"length": length, "episodes": len(paths), "decision_points": sum(len(e["features"])
                     for e in replay.episodes), "prepare_s": round(prepare_s, 2), "steps": args.steps,
                     "steps_per_s": round(args.steps / seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)
    report = {"task": args.task, "seed": args.seed, "host_blocks": args.host_blocks, "target_steps_per_s": 2000,
              "torch_threads": torch.get_num_threads(), "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
