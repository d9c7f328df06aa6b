"""``kvgym bench policy``: what a ranking decision costs on a real cache, and how fast the replay env steps.

- **Decision** (target ≤ 1 ms): a ``context``-token prompt prefilled densely into a ``PagedKVCache`` of the given
  model, then, on that cache, the parts of one ``RankerController.decide``: building the ``CacheView``, the
  view's key summaries and Quest bounds (computed once per view, on first use), ``block_features`` on a view
  that has them, the scorer's forward, ``keep_top``; ``decide_ms``, the whole ``decide`` on a view that has
  them; and ``decision_ms``, what a decision point really costs: a fresh view and ``decide`` on it (the view's
  window: the prefill's last ``stats_window`` queries, which the window-vote features read); then
  ``decode_decision_ms``, the same after one decode step (a window of one query, as at decode's decision
  points); ``budgeted_decode_decision_ms`` and ``lookahead_decision_ms``, a decision and one that drafts
  ``LOOKAHEAD`` tokens (``ranker:...,lookahead=8``) on the cache at its budget, after one more decode step. Medians
  over ``repeats`` (a fifth of them for the lookahead). The first decision on a dense prefill at budget 0.25 moves 75% of the blocks (the most
  ``keep_top`` ever writes); later ones move few.
- **Replay env** (target ≥ 2,000 steps/s): ``RankingReplayEnv`` over every recorded decision of a
  ``python -m benchmarks.ranker_tools collect`` folder (all held in memory), random keep scores, reset + step per episode.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

LOOKAHEAD = 8  # tokens drafted by the timed lookahead decision (the setting measured on the validation families)


def _times_ms(fn, repeats: int) -> dict:
    """Milliseconds per call of ``fn`` over ``repeats`` calls after one warm-up: median, mean, 90th percentile."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - start))
    return {"median_ms": statistics.median(samples), "mean_ms": statistics.fmean(samples),
            "p90_ms": float(np.percentile(samples, 90)), "repeats": repeats}


def bench_decision(model, policy: str | Path, context: int = 2048, budget: float = 0.25, repeats: int = 50,
                   seed: int = 0) -> dict:
    """Time one ranking decision (features, scorer, top-b) on a cache of ``context`` tokens."""
    from agents.ranker.controller import RankerController
    from cache.controller import CacheView, apply_decisions
    from cache.paged_cache import CacheConfig, PagedKVCache
    from cache.ranking import block_features, keep_top
    from cache.runner import budget_blocks

    controller = RankerController(str(policy))
    cache = PagedKVCache(model.config, CacheConfig(max_tokens=context + 64))
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    try:
        blocks = budget_blocks(budget, context, cache.block_size, cache.num_layers, cache.config.sink_blocks + 1)

        def fresh_view():
            return CacheView.from_cache(cache, blocks, phase="compress")

        def view_summaries():
            fresh = fresh_view()
            return fresh.mean_key, fresh.page_bound, fresh.query_similarity, fresh.window_bound_share

        view = fresh_view()
        features = block_features(view)
        keep, merge = controller.scores(view)
        after_prefill = {
            "context": context, "budget": budget, "layers": cache.num_layers, "blocks_per_layer": view.num_blocks,
            "torch_threads": torch.get_num_threads(),
            "view_ms": _times_ms(fresh_view, repeats),
            "view_summaries_ms": _times_ms(view_summaries, repeats),
            "block_features_ms": _times_ms(lambda: block_features(view), repeats),
            "scorer_forward_ms": _times_ms(lambda: controller._model(features), repeats),
            "keep_top_ms": _times_ms(lambda: keep_top(view, keep, merge), repeats),
            "decide_ms": _times_ms(lambda: controller.decide(view), repeats),
            "decision_ms": _times_ms(lambda: controller.decide(fresh_view()), repeats),
            "window_queries": view.window_queries[0].shape[1],
            "target_ms": 1.0,
        }
        with torch.no_grad():  # one decode step: the window is its one query (decode's decision points)
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
        after_decode = {"decode_decision_ms": _times_ms(
            lambda: controller.decide(CacheView.from_cache(cache, blocks, phase="decode")), repeats)}
        # the cache at its budget (the decision applied), one more decode step: a decision there, and one that
        # drafts LOOKAHEAD tokens ahead over the device blocks (the ranker's ``lookahead``)
        apply_decisions(cache, controller.decide(CacheView.from_cache(cache, blocks, phase="decode")))
        with torch.no_grad():
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
        token_ids = torch.cat([ids[0], ids[0, -1:], ids[0, -1:]])
        drafting = RankerController(str(policy), lookahead=LOOKAHEAD)

        def budgeted():
            return CacheView.from_cache(cache, blocks, phase="decode", model=model, token_ids=token_ids)

        return {**after_prefill, **after_decode, "lookahead_tokens": LOOKAHEAD,
                "budgeted_decode_decision_ms": _times_ms(lambda: controller.decide(budgeted()), repeats),
                "lookahead_decision_ms": _times_ms(lambda: drafting.decide(budgeted()), max(repeats // 5, 3))}
    finally:
        cache.close()


def bench_replay(folder: str | Path, steps: int = 20_000, seed: int = 0) -> dict:
    """Steps per second of the ranking replay env over recorded decision points."""
    from kvgym.envs.decisions import Decisions, RankingReplayEnv, load_records

    paths = sorted(Path(folder).glob("*.pt"))
    if not paths:
        raise ValueError(f"--decisions {folder}: no decision points (.pt) there; make them with `python -m benchmarks.ranker_tools collect`")
    start = time.perf_counter()
    decisions = Decisions(load_records(paths))
    prepare_s = time.perf_counter() - start
    env = RankingReplayEnv(decisions)
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    actions = rng.uniform(-1, 1, (256, env.max_blocks)).astype(np.float32)
    start = time.perf_counter()
    for step in range(steps):
        env.reset()
        env.step(actions[step % len(actions)])
    elapsed = time.perf_counter() - start
    return {"decision_files": len(paths), "rows": len(decisions), "max_blocks": env.max_blocks,
            "prepare_s": prepare_s, "steps": steps, "steps_per_s": steps / elapsed, "target_steps_per_s": 2000}
