"""What the saved full-cache references save: adding one controller to an eval folder, with the folder's
``references/`` (the full cache's first-position logits read back) and without them (the full cache runs again,
as before), side by side in one process on the same samples. Writes JSON with both wall times, their ratio and
whether the added controller's records are the same both ways.

    python -m benchmarks.eval_references --n 3 --json results/bench_eval_references.json   # run alone
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from cache.models import load_model
from eval.harness import evaluate
from eval.records import REFERENCES, TIMING_FIELDS

FIRST, ADDED = "keydiff", "tova"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    loaded = load_model()
    settings = dict(budgets=[0.125], tasks=["niah_single"], lengths=[args.length], n=args.n, seed=7, chat=False,
                    protocol="streaming", host_blocks=512, progress=False, plots=False, model_name="smollm2-135m")
    with tempfile.TemporaryDirectory() as tmp:
        kept, rerun = Path(tmp) / "kept", Path(tmp) / "rerun"
        evaluate(loaded.model, loaded.tokenizer, [FIRST], out_dir=kept, **settings)
        shutil.copytree(kept, rerun)
        shutil.rmtree(rerun / REFERENCES)  # the folder as an earlier kvgym left it
        seconds = {}
        for name, folder in (("with_references", kept), ("without_references", rerun)):
            start = time.perf_counter()
            evaluate(loaded.model, loaded.tokenizer, [FIRST, ADDED], out_dir=folder, **settings)
            seconds[name] = time.perf_counter() - start
        added = {name: sorted(json.dumps({k: v for k, v in record.items() if k not in TIMING_FIELDS}, sort_keys=True)
                               for record in map(json.loads, (folder / "samples.jsonl").read_text().splitlines())
                               if record["controller"] == ADDED)
                 for name, folder in (("with", kept), ("without", rerun))}
    report = {"length": args.length, "n": args.n, "protocol": "streaming", "first": FIRST, "added": ADDED,
              "torch_threads": torch.get_num_threads(), "seconds": seconds,
              "speedup": seconds["without_references"] / seconds["with_references"],
              "same_records": added["with"] == added["without"]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
