"""``kvgym bench eval``: evaluation throughput, the same grid with and without shared dense prefills.

In the one-shot protocols every run of a sample starts from the same dense prefill; the harness computes it
once and hands each run a copy (``PagedKVCache.clone``). The benchmark runs one grid twice, side by side in
one process, ``share_prefill=False`` (every run prefills: how the harness worked before) then ``True``, into
fresh folders, and reports runs per hour, the speed-up, and whether the two produced the same answers (they
must: sharing changes the cost, not the result).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

DEFAULT_CONTROLLERS = "h2o,tova,snapkv,streamingllm,lru"


def bench_eval(model, tokenizer, controllers: str = DEFAULT_CONTROLLERS, budgets: str = "0.125,0.25,0.5",
               tasks: str = "passkey", lengths: str = "1024", n: int = 2, protocol: str = "oneshot-question",
               model_name: str | None = None, progress=None) -> dict:
    """Time the grid without and with shared prefills; returns the report (see the module docstring)."""
    from eval.harness import evaluate

    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvgym-bench-eval-") as root:
        for share in (False, True):
            out = Path(root) / ("shared" if share else "per_run")
            start = time.perf_counter()
            evaluate(model, tokenizer, controllers, budgets, tasks, lengths, n, 0, out, chat=False, host_blocks=0,
                     protocol=protocol, share_prefill=share, model_name=model_name, progress=False, plots=False)
            seconds = time.perf_counter() - start
            records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
            rows[share] = {"share_prefill": share, "runs": len(records), "seconds": round(seconds, 2),
                           "runs_per_hour": round(3600 * len(records) / seconds, 1),
                           "answers": {(r["controller"], r["budget"], r["task"], r["index"]): r["text"] for r in records}}
            if progress:
                progress({k: v for k, v in rows[share].items() if k != "answers"})
    same = rows[False]["answers"] == rows[True]["answers"]
    return {
        "grid": {"controllers": controllers, "budgets": budgets, "tasks": tasks, "lengths": lengths, "n": n,
                 "protocol": protocol, "model": model_name},
        "per_run_prefill": {k: v for k, v in rows[False].items() if k != "answers"},
        "shared_prefill": {k: v for k, v in rows[True].items() if k != "answers"},
        "speedup": round(rows[True]["runs_per_hour"] / rows[False]["runs_per_hour"], 2),
        "same_answers": same,
    }
