"""``kvgym bench eval``: evaluation throughput, the same grid with and without shared dense prefills and batched runs.

In the one-shot protocols every run of a sample starts from the same dense prefill; the harness computes it
once and hands each run a copy (``PagedKVCache.clone``). With ``batch_runs`` a sample's runs then go in lockstep,
their forwards batched (``cache.driving.run_batched``). The benchmark runs one grid side by side in one process,
into fresh folders: ``per_run`` (every run prefills: how the harness first worked; one-shot protocols only),
``shared`` and ``shared_batched``, and reports runs per hour, the speed-ups, and whether the settings produced the
same answers (sharing must not change them; batching only to float rounding).
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

    settings = {"per_run": (False, False), "shared": (True, False), "shared_batched": (True, True)}
    if protocol not in ("oneshot", "oneshot-question"):  # nothing to share: the first two are the same
        del settings["per_run"]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvgym-bench-eval-") as root:
        for name, (share, batch) in settings.items():
            out = Path(root) / name
            start = time.perf_counter()
            evaluate(model, tokenizer, controllers, budgets, tasks, lengths, n, 0, out, chat=False, host_blocks=0,
                     protocol=protocol, share_prefill=share, batch_runs=batch, model_name=model_name, progress=False,
                     plots=False)
            seconds = time.perf_counter() - start
            records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
            rows[name] = {"share_prefill": share, "batch_runs": batch, "runs": len(records),
                          "seconds": round(seconds, 2), "runs_per_hour": round(3600 * len(records) / seconds, 1),
                          "answers": {(r["controller"], r["budget"], r["task"], r["index"]): (r["text"], r["score"])
                                      for r in records}}
            if progress:
                progress({"setting": name, **{k: v for k, v in rows[name].items() if k != "answers"}})
    first = next(iter(rows))
    return {
        "grid": {"controllers": controllers, "budgets": budgets, "tasks": tasks, "lengths": lengths, "n": n,
                 "protocol": protocol, "model": model_name},
        **{name: {k: v for k, v in row.items() if k != "answers"} for name, row in rows.items()},
        "speedup_over_" + first: {name: round(row["runs_per_hour"] / rows[first]["runs_per_hour"], 2)
                                  for name, row in rows.items()},
        "same_answers": {name: row["answers"] == rows[first]["answers"] for name, row in rows.items()},
    }
