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
