"""Replay vs live: run the same policies on both envs and compare their returns (rank correlations), and the
replay returns of policies over a trace set (``kvgym traces compare``).

Policies are ``agents.scripted.make_policy`` specs: scripted policies, any registered controller, ``ppo:PATH``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from agents.scripted import Policy, make_policy, policy_inputs
from kvgym.envs.paged_kv import PagedKVCacheEnv
from kvgym.envs.replay import PagedKVCacheReplayEnv
from kvgym.envs.traces import build_trace


def run_episode(env, policy: Policy, rng: np.random.Generator, **reset_kwargs) -> dict:
    """One episode of ``policy`` on a live or replay env: return, KL, bytes, task score, steps, seconds (the
    policy's own time excluded)."""
    start = time.perf_counter()
    env.reset(**reset_kwargs)
    totals = {"return": 0.0, "kl": 0.0, "kl_proxy": 0.0, "bytes_moved": 0, "task_score": 0.0, "lost_mass": 0.0,
              "fallbacks": 0}
    steps, policy_time = 0, 0.0
    while True:
        tick = time.perf_counter()
        action = policy(*policy_inputs(env), rng)
        policy_time += time.perf_counter() - tick
        _, reward, terminated, truncated, info = env.step(action)
        steps += 1
        totals["return"] += reward
        for key in ("kl", "kl_proxy", "bytes_moved", "task_score", "lost_mass", "fallbacks"):
            totals[key] += info.get(key, 0)
        if terminated or truncated:
            break
    return {**totals, "steps": steps, "seconds": time.perf_counter() - start - policy_time}


def rankdata(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties get their average rank (``scipy.stats.rankdata``'s default)."""
    values = np.asarray(values, dtype=np.float64)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts
    return (starts + (counts + 1) / 2.0)[inverse]


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation of ``x`` and ``y`` (NaN for fewer than two points)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denominator) if denominator > 0 else float("nan")


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson on average ranks); NaN when either side is constant."""
    return pearson(rankdata(x), rankdata(y))


DEFAULT_POLICIES = ("fallback", "lru", "h2o", "streamingllm", "fifo", "evict:mass,extra=2", "evict:newest,extra=4",
                    "evict:recent", "merge:neighbour", "prefetch", "random:0.2", "random:0.5")


def replay_live_correlation(model, tokenizer, controllers: Sequence[str] = DEFAULT_POLICIES, episodes: int = 4,
                            seed: int = 0, tasks: Sequence[str] = ("passkey",), lengths: Sequence[int] = (1024,),
                            budget_range=(0.125, 0.5), num_candidates: int = 32, prefill_chunk: int = 64,
                            decide_every: int = 8, max_new_tokens: int | None = None, kl_positions: int = 8,
                            lambda_bytes: float = 0.01, lambda_task: float = 1.0, host_blocks: int | None = None,
                            chat: bool = False, replay_kwargs: dict | None = None,
                            progress: Callable[[dict], None] | None = None) -> dict:
    """Run every policy in ``controllers`` (``make_policy`` specs) on the live env and on the replay env over the
    same ``episodes`` (task sample and budget drawn by the live env's ``reset(seed=seed + e)``; the replay env
    replays the full-cache trace of that sample at that budget), with the same decisions (each policy maps the
    view and encoded observation to an action; its RNG is seeded per episode), and compare episode returns.

    Returns ``spearman`` (all policy × episode pairs), ``spearman_within_episode`` (mean over episodes of the
    rank correlation across policies: does replay rank policies as live does?), ``pearson``, ``spearman_kl``
    (live KL vs replay KL), ``kl_scale_fit`` (least-squares live KL per unit of the replay's KL proxy, over whole
    episodes: a ``kl_scale`` for the replay env), steps per second of both envs, and every pair in ``rows``.
    """
    live = PagedKVCacheEnv(model, tokenizer, tasks=tasks, lengths=lengths, budget_range=budget_range,
                           num_candidates=num_candidates, prefill_chunk=prefill_chunk, decide_every=decide_every,
                           max_new_tokens=max_new_tokens, kl_positions=kl_positions, lambda_bytes=lambda_bytes,
                           lambda_task=lambda_task, host_blocks=host_blocks, chat=chat)
    settings = dict(num_candidates=num_candidates, prefill_chunk=prefill_chunk, decide_every=decide_every,
                    budget_range=budget_range, lambda_bytes=lambda_bytes, host_blocks=host_blocks,
                    **(replay_kwargs or {}))
    rows = []
    start = time.perf_counter()
    trace_seconds = 0.0
    try:
        for episode in range(episodes):
            live.reset(seed=seed + episode)
            tick = time.perf_counter()
            trace = build_trace(model, tokenizer, live.prompt_ids, prefill_chunk=prefill_chunk,
                                max_new_tokens=live.new_tokens, meta={"task": live.sample.task})
            trace_seconds += time.perf_counter() - tick
            replay = PagedKVCacheReplayEnv([trace], **settings)
            fraction = live.budget_fraction
            for spec in controllers:
                live_result = run_episode(live, make_policy(spec), np.random.default_rng([seed, episode]),
                                          seed=seed + episode)
                replay_result = run_episode(replay, make_policy(spec), np.random.default_rng([seed, episode]),
                                            options={"trace": 0, "budget_fraction": fraction})
                row = {"episode": episode, "policy": spec, "task": live.sample.task, "length": live.sample.length,
                       "budget_fraction": fraction, **{f"live_{k}": v for k, v in live_result.items()},
                       **{f"replay_{k}": v for k, v in replay_result.items()}}
                rows.append(row)
                if progress is not None:
                    progress(row)
    finally:
        live.close()
    column = lambda key: np.array([row[key] for row in rows], np.float64)  # noqa: E731
    live_returns, replay_returns = column("live_return"), column("replay_return")
    within = [spearman([r["live_return"] for r in rows if r["episode"] == e],
                       [r["replay_return"] for r in rows if r["episode"] == e]) for e in range(episodes)]
    within = [w for w in within if not math.isnan(w)]
    live_kl, replay_kl, proxy = column("live_kl"), column("replay_kl"), column("replay_kl_proxy")
    fit = float(live_kl @ proxy / (proxy @ proxy)) if float(proxy @ proxy) > 0 else float("nan")
    rate = lambda prefix: float(column(f"{prefix}_steps").sum() / max(column(f"{prefix}_seconds").sum(), 1e-9))  # noqa: E731
    return {
        "spearman": spearman(live_returns, replay_returns),
        "spearman_within_episode": float(np.mean(within)) if within else float("nan"),
        "pearson": pearson(live_returns, replay_returns),
        "spearman_kl": spearman(live_kl, replay_kl),
        "kl_scale_fit": fit,
        "live_steps_per_s": rate("live"), "replay_steps_per_s": rate("replay"),
        "policies": list(controllers), "episodes": episodes, "pairs": len(rows),
        "seconds": time.perf_counter() - start, "trace_seconds": trace_seconds, "rows": rows,
    }


def replay_returns(traces, policies: Sequence[str], budgets: Sequence[float] = (0.125, 0.25, 0.5),
                   env_kwargs: dict | None = None) -> dict:
    """Mean episode return, KL and lost mass of each policy (``make_policy`` specs) on the replay env, over every
    trace × budget (the same episodes for every policy; deterministic policies give deterministic numbers)."""
    env = PagedKVCacheReplayEnv(traces, **(env_kwargs or {}))
    table = {}
    for spec in policies:
        per_budget = {}
        for budget in budgets:
            results = [run_episode(env, make_policy(spec), np.random.default_rng(index),
                                   options={"trace": index, "budget_fraction": float(budget)})
                       for index in range(len(env.sources))]
            per_budget[str(budget)] = {key: float(np.mean([r[key] for r in results]))
                                       for key in ("return", "kl", "lost_mass", "fallbacks")}
        table[spec] = per_budget
    return {"episodes_per_budget": len(env.sources), "budgets": list(budgets), "policies": table}

