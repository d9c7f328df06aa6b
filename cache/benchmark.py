"""Decode and prefill speed of the paged cache against transformers' ``DynamicCache``, interleaved.

Both caches run on the same model and prompt. Decode steps alternate between the two in a random order
each step, so machine noise hits both alike; medians of per-step times are reported. Prefills alternate
too (``prefill_repeats`` each, medians). Ratios within one
run are meaningful; absolute times across runs on a shared machine are not.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from transformers import DynamicCache

from cache.paged_cache import CacheConfig, PagedKVCache


def prose_token_ids(tokenizer, length: int, text: str) -> torch.Tensor:
    """``[1, length]`` token ids of ``text``, repeated as needed."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    repeats = -(-length // ids.numel())
    return ids.repeat(repeats)[:length].reshape(1, -1)


@torch.no_grad()
def bench_cache(model, tokenizer, text: str, contexts: list[int], decode_steps: int = 16, prefill_repeats: int = 3,
                seed: int = 0, progress=None) -> dict:
    rng = random.Random(seed)
    device = next(model.parameters()).device
    results = []
    for context in contexts:
        if context + decode_steps > model.config.max_position_embeddings:
            raise ValueError(f"context {context} + {decode_steps} decode steps exceeds the model's positions")
        ids = prose_token_ids(tokenizer, context, text).to(device)
        caches = {
            "dynamic": lambda: DynamicCache(config=model.config),
            "paged": lambda capacity=context + decode_steps + 1: PagedKVCache(model.config,
                                                                                CacheConfig(max_tokens=capacity)),
        }
        prefill = {name: [] for name in caches}
        live, next_token = {}, {}
        for repeat in range(prefill_repeats):  # alternate which cache goes first
            for name in (["dynamic", "paged"] if repeat % 2 == 0 else ["paged", "dynamic"]):
                cache = caches[name]()
                start = time.perf_counter()
                out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                prefill[name].append(time.perf_counter() - start)
                live[name], next_token[name] = cache, out.logits[:, -1:].argmax(-1)
        step_ms = {name: [] for name in caches}
        agree = True
        for _ in range(decode_steps):
            names = list(caches)
            rng.shuffle(names)
            for name in names:
                start = time.perf_counter()
                out = model(input_ids=next_token[name], cache=live[name], use_cache=True)
                step_ms[name].append(1000 * (time.perf_counter() - start))
                next_token[name] = out.logits[:, -1:].argmax(-1)
            agree &= bool(next_token["dynamic"].item() == next_token["paged"].item())
        dynamic_ms, paged_ms = statistics.median(step_ms["dynamic"]), statistics.median(step_ms["paged"])
        dynamic_prefill, paged_prefill = statistics.median(prefill["dynamic"]), statistics.median(prefill["paged"])
        results.append({
            "context": context, "decode_steps": decode_steps, "prefill_repeats": prefill_repeats,
            "dynamic_ms": round(dynamic_ms, 2), "paged_ms": round(paged_ms, 2), "ratio": round(paged_ms / dynamic_ms, 3),
            "dynamic_prefill_s": round(dynamic_prefill, 3), "paged_prefill_s": round(paged_prefill, 3),
            "prefill_ratio": round(paged_prefill / dynamic_prefill, 3), "greedy_tokens_agree": agree,
        })
        if progress is not None:
            progress(results[-1])
    return {"results": results}


def _median_ms(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.no_grad()
def bench_ops(model, tokenizer, text: str, contexts: list[int], budget: float = 0.25, decode_steps: int = 16,
              op_context: int = 1024, repeats: int = 5, seed: int = 0, progress=None) -> dict:
    """Time per operation (evict, prefetch, merge of one block across all layers), the cost of building a
    ``CacheView``, and decode ms/token under a budget vs the full cache at each context (interleaved)."""
    from cache.controller import CacheView, EvictOldest, apply_decisions
    from cache.runner import budget_blocks

    device = next(model.parameters()).device
    num_layers = model.config.num_hidden_layers

    # operations: one block across all layers, on a cache holding op_context tokens with a host and disk tier
    ids = prose_token_ids(tokenizer, op_context, text).to(device)
    blocks = op_context // 16
    cache = PagedKVCache(model.config, CacheConfig(max_tokens=op_context + 64, host_blocks=repeats,
                                                   disk_blocks=repeats))
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    victims = iter(range(1, blocks - 1))

    def across_layers(operation, block):
        for layer in range(num_layers):
            getattr(cache, operation)(layer, block)

    evicted, operations = [], {}
    operations["evict_to_host_ms"] = _median_ms(
        lambda: evicted.append(b := next(victims)) or across_layers("evict", b), repeats)
    operations["prefetch_from_host_ms"] = _median_ms(lambda: across_layers("prefetch", evicted.pop()), repeats)
    for _ in range(repeats):  # fill the host tier so the next evictions go to disk
        across_layers("evict", next(victims))
    operations["evict_to_disk_ms"] = _median_ms(
        lambda: evicted.append(b := next(victims)) or across_layers("evict", b), repeats)
    operations["prefetch_from_disk_ms"] = _median_ms(lambda: across_layers("prefetch", evicted.pop()), repeats)
    operations["merge_ms"] = _median_ms(lambda: across_layers("merge", next(victims)), repeats)
    # one decode step (it rebuilds the mirrors the operations above invalidated, then reads them)
    token = ids[:, -1:]
    model(input_ids=token, cache=cache, use_cache=True)
    decode_ms = _median_ms(lambda: model(input_ids=token, cache=cache, use_cache=True), repeats)
    budget_list = budget_blocks(budget, op_context, 16, num_layers, 2)
    view_ms = _median_ms(lambda: CacheView.from_cache(cache, budget_list), repeats * 4)

    def view_with_similarities():
        view = CacheView.from_cache(cache, budget_list)
        return view.query_similarity, view.neighbour_similarity, view.legal_ops

    view_full_ms = _median_ms(view_with_similarities, repeats)
    operations.update({
        "context": op_context, "decode_step_ms": round(decode_ms, 2), "view_ms": round(view_ms, 3),
        "view_share_of_decode_step": round(view_ms / decode_ms, 4),
        "view_with_similarities_ms": round(view_full_ms, 3),
    })
    operations = {k: round(v, 3) if isinstance(v, float) else v for k, v in operations.items()}
    cache.close()
    if progress is not None:
        progress(operations)

    # decode under a budget vs the full cache, interleaved step by step
    rng = random.Random(seed)
    decode = []
    for context in contexts:
        total = context + decode_steps + 1
        ids = prose_token_ids(tokenizer, context, text).to(device)
        budget_list = budget_blocks(budget, context, 16, num_layers, 2)
        runs = {}
        for name in ("full", "budgeted"):
            cache = PagedKVCache(model.config, CacheConfig(max_tokens=total))
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            if name == "budgeted":
                apply_decisions(cache, EvictOldest().decide(CacheView.from_cache(cache, budget_list)))
            runs[name] = {"cache": cache, "token": out.logits[:, -1:].argmax(-1), "ms": []}
        for _ in range(decode_steps):
            names = list(runs)
            rng.shuffle(names)
            for name in names:
                run = runs[name]
                start = time.perf_counter()
                out = model(input_ids=run["token"], cache=run["cache"], use_cache=True)
                run["token"] = out.logits[:, -1:].argmax(-1)
                if name == "budgeted":  # the runner's decision point: keep the budget every step
                    cache = run["cache"]
                    apply_decisions(cache, EvictOldest().decide(CacheView.from_cache(cache, budget_list)))
                run["ms"].append(1000 * (time.perf_counter() - start))
        full_ms, budgeted_ms = (statistics.median(runs[name]["ms"]) for name in ("full", "budgeted"))
        decode.append({"context": context, "budget": budget, "budget_blocks_per_layer": budget_list[0],
                       "full_ms": round(full_ms, 2), "budgeted_ms": round(budgeted_ms, 2),
                       "ratio": round(budgeted_ms / full_ms, 3)})
        if progress is not None:
            progress(decode[-1])
    return {"operations": operations, "decode": decode}
