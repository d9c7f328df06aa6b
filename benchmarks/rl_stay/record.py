"""Record full-cache episodes for the replay twin (``kvgym.envs.kvcache_replay.record_episodes``): the training and
validation families on their own seeds, and the held-out families on the seed the live held-out grid uses (7):
``record_episodes`` draws ``kvgym eval --seed``'s samples, so a policy chosen on the replay can be checked live on
the same samples (the episodes of results/rl_stay/ were recorded before it did: other samples of the same
families). Resumable (files are kept).

    python -m benchmarks.rl_stay.record --out data/replay_stay
"""

from __future__ import annotations

import argparse
from pathlib import Path

SETS = {  # folder: (task, seed, n)
    "train": ("families_train", 501, 24),
    "validation": ("families_train", 502, 6),
    "heldout": ("families_heldout", 7, 10),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/replay_stay"))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--sets", default=",".join(SETS))
    args = parser.parse_args()
    from cache.models import load_model
    from kvgym.envs.kvcache_replay import record_episodes

    loaded = load_model("smollm2-135m")
    for name in args.sets.split(","):
        task, seed, n = SETS[name]
        record_episodes(loaded.model, loaded.tokenizer, [task], [args.length], n, seed, args.out / name,
                        protocol="streaming", chat=False)


if __name__ == "__main__":
    main()
