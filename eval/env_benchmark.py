"""``kvgym bench env``: env steps per second (live single, live batched, replay) on the tiny random model and on
SmolLM2, and the replay-vs-live reward correlation, in one JSON (ratios measured side by side in one run)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def _live_rates(model, tokenizer, label: str, num_envs: list[int], steps: int, env_kwargs: dict) -> list[dict]:
    from kvgym.envs.paged_kv import PagedKVCacheEnv
    from kvgym.envs.vector import PagedKVCacheVecEnv, steps_per_second

    rows = []
    single = PagedKVCacheEnv(model, tokenizer, **env_kwargs)
    steps_per_second(single, 2)  # warm-up (and the first sample's full-cache reference)
    rows.append({"model": label, "mode": "live", "num_envs": 1, **steps_per_second(single, steps)})
    single.close()
    for n in num_envs:
        vec = PagedKVCacheVecEnv(n, model=model, tokenizer=tokenizer, **env_kwargs)
        result = steps_per_second(vec, steps * n)  # the same steps per episode as the single env: same phases
        rows.append({"model": label, "mode": "live_batched", "num_envs": n, "model_calls": vec.model_calls, **result})
        vec.close()
    base = rows[0]["steps_per_s"]
    for row in rows:
        row["speedup_vs_single"] = row["steps_per_s"] / base
    return rows


def _replay_rate(traces, steps: int, env_kwargs: dict) -> dict:
    from kvgym.envs.replay import PagedKVCacheReplayEnv
    from kvgym.envs.vector import steps_per_second

    keys = ("num_candidates", "prefill_chunk", "decide_every", "budget_range", "lambda_bytes")
    env = PagedKVCacheReplayEnv(traces, **{k: env_kwargs[k] for k in keys if k in env_kwargs})
    steps_per_second(env, 50)
    return {"mode": "replay", "num_envs": 1, **steps_per_second(env, steps)}


def bench_env(smollm2=None, num_envs=(4, 8), live_steps: int = 40, replay_steps: int = 3000, traces=None,
              correlation_episodes: int = 3, task: str = "passkey", length: int = 1024, progress=print) -> dict:
    """``smollm2``: a ``LoadedModel`` (None: the tiny model only). ``traces``: a replay trace folder (None: one
    trace of a SmolLM2 sample is built here, and none without SmolLM2); the replay rate is measured over the whole
    folder, after the env has prepared its traces. ``correlation_episodes`` 0 skips the correlation.

    Live rates count env steps over random legal actions, ``live_steps`` per env (about two 1024-token episodes:
    prefill chunks and decode steps), including each new sample's full-cache reference pass (one sequence at a
    time, also in the batched env)."""
    import torch

    from cache.models import tiny_random_llama
    from eval.replay_compare import replay_live_correlation
    from eval.tasks.base import get_task
    from kvgym.envs.traces import build_trace

    env_kwargs = dict(tasks=(task,), lengths=(length,), budget_range=(0.125, 0.5), num_candidates=32,
                      prefill_chunk=64, decide_every=8)
    report: dict = {"settings": {**env_kwargs, "live_steps": live_steps, "replay_steps": replay_steps,
                                 "torch_threads": torch.get_num_threads()}, "rows": []}
    start = time.perf_counter()
    tokenizer = smollm2.tokenizer if smollm2 is not None else None
    if tokenizer is None:
        from cache.models import load_model

        tokenizer = load_model("smollm2-135m").tokenizer
    tiny = tiny_random_llama(vocab_size=len(tokenizer), max_positions=4096)
    for row in _live_rates(tiny, tokenizer, "tiny-random", list(num_envs), live_steps * 4, env_kwargs):
        report["rows"].append(row)
        progress(row)
    if smollm2 is not None:
        for row in _live_rates(smollm2.model, tokenizer, "smollm2-135m", list(num_envs), live_steps, env_kwargs):
            report["rows"].append(row)
            progress(row)
        if traces is None:
            sample = get_task(task)(tokenizer, length, 7, 0)
            traces = [build_trace(smollm2.model, tokenizer, sample, prefill_chunk=64)]
    if traces is not None:
        row = {"model": "smollm2-135m" if smollm2 is not None else "traces", "traces": str(traces) if
               isinstance(traces, (str, Path)) else len(traces), **_replay_rate(traces, replay_steps, env_kwargs)}
        report["rows"].append(row)
        progress(row)
    if smollm2 is not None:
        if correlation_episodes > 0:
            correlation = replay_live_correlation(smollm2.model, tokenizer, episodes=correlation_episodes,
                                                  tasks=(task,), lengths=(length,))
            report["correlation"] = {k: v for k, v in correlation.items() if k != "rows"}
            progress(report["correlation"])
    report["seconds"] = time.perf_counter() - start
    replay = [row["steps_per_s"] for row in report["rows"] if row["mode"] == "replay"]
    report["replay_target_met"] = bool(replay) and min(replay) >= 2000
    return report


def write_report(report: dict | list, path: Path) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folder created)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=lambda o: float(o) if isinstance(o, np.floating) else str(o)))
