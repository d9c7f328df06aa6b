"""Speed benchmarks of the paged cache (``kvgym bench cache / ops / roofline``), interleaved.

- ``bench_cache``: decode and prefill of the paged cache against transformers' ``DynamicCache``;
- ``bench_ops``: time per operation, the controller view's cost, and decode under a budget (evicting or
  merging) against the full cache;
- ``bench_roofline``: decode time against the machine's memory roofline (weights + resident KV bytes per
  token ÷ measured bandwidth).

The runs compared step in a random order each step, so machine noise hits them alike; medians of per-step
times are reported. Prefills alternate too (``prefill_repeats`` each, medians). Ratios within one run are
meaningful; absolute times across runs on a shared machine are not.
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
    """Paged cache against ``DynamicCache``: prefill and decode time and bytes read per context length."""
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
        prefill_cpu = {name: [] for name in caches}
        live, next_token = {}, {}
        for repeat in range(prefill_repeats):  # alternate which cache goes first
            for name in (["dynamic", "paged"] if repeat % 2 == 0 else ["paged", "dynamic"]):
                if name == "paged" and name in live:  # done with, as the harness closes each run's cache:
                    live[name].close()  # the next paged cache reuses its storage (the first one allocates)
                cache = caches[name]()
                start, start_cpu = time.perf_counter(), time.process_time()
                out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
                prefill[name].append(time.perf_counter() - start)
                prefill_cpu[name].append(time.process_time() - start_cpu)
                live[name], next_token[name] = cache, out.logits[:, -1:].argmax(-1)
        step_ms = {name: [] for name in caches}
        step_cpu_ms = {name: [] for name in caches}
        agree = True
        for _ in range(decode_steps):
            names = list(caches)
            rng.shuffle(names)
            for name in names:
                start, start_cpu = time.perf_counter(), time.process_time()
                out = model(input_ids=next_token[name], cache=live[name], use_cache=True)
                step_ms[name].append(1000 * (time.perf_counter() - start))
                step_cpu_ms[name].append(1000 * (time.process_time() - start_cpu))
                next_token[name] = out.logits[:, -1:].argmax(-1)
            agree &= bool(next_token["dynamic"].item() == next_token["paged"].item())
        dynamic_ms, paged_ms = statistics.median(step_ms["dynamic"]), statistics.median(step_ms["paged"])
        dynamic_prefill, paged_prefill = statistics.median(prefill["dynamic"]), statistics.median(prefill["paged"])
        cpu = {name: (statistics.median(step_cpu_ms[name]), statistics.median(prefill_cpu[name])) for name in caches}
        results.append({
            "context": context, "decode_steps": decode_steps, "prefill_repeats": prefill_repeats,
            "dynamic_ms": round(dynamic_ms, 2), "paged_ms": round(paged_ms, 2), "ratio": round(paged_ms / dynamic_ms, 3),
            "dynamic_prefill_s": round(dynamic_prefill, 3), "paged_prefill_s": round(paged_prefill, 3),
            "prefill_ratio": round(paged_prefill / dynamic_prefill, 3), "greedy_tokens_agree": agree,
            "prefill_s_each": {name: [round(t, 3) for t in times] for name, times in prefill.items()},
            # CPU time of this process (all its threads): unlike wall time, not inflated by waiting for a core
            # that other processes hold, so steadier on a shared machine
            "cpu_ratio": round(cpu["paged"][0] / cpu["dynamic"][0], 3),
            "prefill_cpu_s": {name: round(value[1], 3) for name, value in cpu.items()},
            "prefill_cpu_ratio": round(cpu["paged"][1] / cpu["dynamic"][1], 3),
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


class _MergeOldest:
    """``EvictOldest``'s choice of blocks, merged instead of evicted (the benchmark's merging policy)."""

    def decide(self, view):
        from cache.controller import Decision, EvictOldest, Op

        return [Decision(d.layer, d.block, Op.MERGE) for d in EvictOldest().decide(view)]


def _controllers() -> dict:
    from cache.controller import EvictOldest

    return {"budgeted": EvictOldest(), "budgeted_merge": _MergeOldest()}


def _decode_interleaved(model, runs: dict, steps: int, budget_list: list[int], rng: random.Random) -> None:
    """Decode ``steps`` tokens in every run, in a random order each step; a run with a ``controller`` gets a
    decision point after every step (the runner's decode loop). Appends per-step ``forward_ms`` and
    ``step_ms`` (forward + decision) and the KV bytes attention read (``kv_bytes``) to each run."""
    from cache.controller import CacheView, apply_decisions

    for _ in range(steps):
        names = list(runs)
        rng.shuffle(names)
        for name in names:
            run = runs[name]
            start = time.perf_counter()
            out = model(input_ids=run["token"], cache=run["cache"], use_cache=True)
            run["token"] = out.logits[:, -1:].argmax(-1)
            forward = time.perf_counter()
            if run.get("controller") is not None:
                cache = run["cache"]
                apply_decisions(cache, run["controller"].decide(CacheView.from_cache(cache, budget_list)))
            end = time.perf_counter()
            run.setdefault("forward_ms", []).append(1000 * (forward - start))
            run.setdefault("step_ms", []).append(1000 * (end - start))
            run.setdefault("kv_bytes", []).append(sum(run["cache"].last_bytes_read))


def _prefilled_runs(model, ids, total: int, budget_list: list[int], names: list[str]) -> dict:
    """One dense prefill of ``ids``; the budgeted runs are clones of it brought within budget by their
    controller (the full run keeps everything)."""
    from cache.controller import CacheView, apply_decisions

    cache = PagedKVCache(model.config, CacheConfig(max_tokens=total))
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    controllers = _controllers()
    runs = {}
    for name in names:
        run_cache = cache if name == "full" else cache.clone()
        controller = controllers.get(name)
        if controller is not None:
            apply_decisions(run_cache, controller.decide(CacheView.from_cache(run_cache, budget_list)))
        runs[name] = {"cache": run_cache, "token": token.clone(), "controller": controller}
    return runs


@torch.no_grad()
def bench_ops(model, tokenizer, text: str, contexts: list[int], budget: float = 0.25, decode_steps: int = 32,
              op_context: int = 1024, repeats: int = 5, seed: int = 0, progress=None) -> dict:
    """Time per operation (evict, prefetch, merge of one block across all layers), the cost of building a
    ``CacheView``, and, at each context, decode ms/token of the full cache, a budgeted cache that evicts the
    oldest blocks and one that merges them (interleaved), and the batched merge of one block per layer."""
    from cache.controller import CacheView
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
    # the first removal after the prefetches rebuilds the mirrors and the first merge computes the key norms
    first = next(victims)
    cache.merge_blocks([(layer, first) for layer in range(num_layers)])
    operations["merge_ms"] = _median_ms(
        lambda: cache.merge_blocks([(layer, b) for b in [next(victims)] for layer in range(num_layers)]), repeats)
    operations["merge_one_call_per_layer_ms"] = _median_ms(lambda: across_layers("merge", next(victims)), repeats)
    # one decode step (it compacts the mirrors the operations above changed, then reads them)
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

    # decode: full cache, budget by eviction, budget by merging; interleaved step by step
    rng = random.Random(seed)
    decode = []
    for context in contexts:
        total = context + decode_steps + 1
        ids = prose_token_ids(tokenizer, context, text).to(device)
        budget_list = budget_blocks(budget, context, 16, num_layers, 2)
        runs = _prefilled_runs(model, ids, total, budget_list, ["full", "budgeted", "budgeted_merge"])
        _decode_interleaved(model, runs, decode_steps, budget_list, rng)
        median = {name: statistics.median(run["step_ms"]) for name, run in runs.items()}
        mean = {name: statistics.fmean(run["step_ms"]) for name, run in runs.items()}
        # the batched merge of one block in each layer, on the full cache at this context
        victims = iter(range(1, context // 16 - 1))

        def merge_next(cache=runs["full"]["cache"], victims=victims):
            block = next(victims)
            cache.merge_blocks([(layer, block) for layer in range(num_layers)])

        merge_next()  # the first merge computes the key norms of the whole mirror
        merge_ms = _median_ms(merge_next, repeats)
        decode.append({
            "context": context, "budget": budget, "budget_blocks_per_layer": budget_list[0], "steps": decode_steps,
            "full_ms": round(median["full"], 2), "budgeted_ms": round(median["budgeted"], 2),
            "ratio": round(median["budgeted"] / median["full"], 3),
            "mean_ms": {name: round(value, 2) for name, value in mean.items()},
            "merge_vs_evict_mean": round(mean["budgeted_merge"] / mean["budgeted"], 3),
            "merge_vs_evict_median": round(median["budgeted_merge"] / median["budgeted"], 3),
            "merge_ms": round(merge_ms, 2),
        })
        for run in runs.values():
            run["cache"].close()
        if progress is not None:
            progress(decode[-1])
    return {"operations": operations, "decode": decode, "threads": torch.get_num_threads()}


def measure_bandwidth(megabytes: int = 512, repeats: int = 7) -> dict:
    """This machine's sustained memory bandwidth with torch, in GB/s (1e9 bytes/s), medians over ``repeats``:
    ``read`` (the sum of a ``megabytes`` fp32 buffer: the bytes read) and ``copy`` (a copy into a second
    buffer: the bytes read plus written). The buffers are far larger than any CPU cache."""
    numel = megabytes * 2**20 // 4
    source = torch.empty(numel).uniform_()
    target = torch.empty_like(source)
    target.copy_(source)  # touch every page once
    read, copy = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        source.sum()
        read.append(4 * numel / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        target.copy_(source)
        copy.append(8 * numel / (time.perf_counter() - start) / 1e9)
    return {"read_gbps": round(statistics.median(read), 2), "copy_gbps": round(statistics.median(copy), 2),
            "read_gbps_best": round(max(read), 2), "buffer_mb": megabytes, "repeats": repeats}


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step must read: every parameter once (tied ones once), except that an input
    embedding not shared with the output head is read one row per token."""
    params = list(model.parameters())  # shared (tied) parameters are listed once
    total = sum(p.numel() * p.element_size() for p in params)
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        total -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    return total


@torch.no_grad()
def measure_matvec(model, repeats: int = 7) -> dict:
    """The weight mat-vecs of one decode step, alone: ``F.linear`` of a one-token input through every
    ``nn.Linear`` of ``model`` (the output head included), one after the other, timed as a whole (median of
    ``repeats`` sweeps). What this torch build's kernels need for the step's bulk of bytes, with no model code
    around them; ``gbps`` = those weights' bytes over that time, beside the bandwidth test's figure."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, m.in_features, dtype=m.weight.dtype, device=m.weight.device) for m in linears]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    for m, x in zip(linears, inputs, strict=True):  # warm up
        torch.nn.functional.linear(x, m.weight, m.bias)
    sweeps = []
    for _ in range(repeats):
        start = time.perf_counter()
        for m, x in zip(linears, inputs, strict=True):
            torch.nn.functional.linear(x, m.weight, m.bias)
        sweeps.append(time.perf_counter() - start)
    seconds = statistics.median(sweeps)
    return {"ms": round(1000 * seconds, 2), "gbps": round(weight_bytes / seconds / 1e9, 2), "linears": len(linears),
            "weight_bytes": weight_bytes, "repeats": repeats}


@torch.no_grad()
def bench_roofline(model, tokenizer, text: str, contexts: list[int], budget: float = 0.25, decode_steps: int = 16,
                   bandwidth_mb: int = 512, seed: int = 0, progress=None) -> dict:
    """Decode time against the memory roofline. The floor of one decode step is the bytes it must read
    (the weights, ``weight_bytes_per_token``, plus the resident KV that attention reads, from the cache's own
    byte counters) at this machine's sustained read bandwidth (``measure_bandwidth``); the report gives, for
    the full cache and the budgeted one (oldest-first eviction, a decision point every step) at each context,
    the median forward ms/token, the floor ms and ``roofline_fraction`` = floor ÷ measured (1 = at the
    roofline). The budgeted run's decision time is reported apart (``decision_ms``). On a shared machine the
    bandwidth moves with the load: it is measured right before and right after each context's decode steps,
    and that context's floor uses the median of those measurements (all of them are in the report).

    Beside it, ``matvec`` (``measure_matvec``, before and after each context): the step's weight mat-vecs
    alone, through this torch build's kernels; each row's ``matvec_fraction`` = their time ÷ the measured step
    (the share of the step the bare kernels already need: a step can be no faster than its mat-vecs)."""
    from cache.runner import budget_blocks

    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError("bench roofline measures host memory bandwidth; run it on the CPU")
    num_layers = model.config.num_hidden_layers
    weights = weight_bytes_per_token(model)
    rng = random.Random(seed)
    rows, bandwidths = [], []
    for context in contexts:
        total = context + decode_steps + 1
        ids = prose_token_ids(tokenizer, context, text).to(device)
        budget_list = budget_blocks(budget, context, 16, num_layers, 2)
        runs = _prefilled_runs(model, ids, total, budget_list, ["full", "budgeted"])
        before, matvec_before = measure_bandwidth(bandwidth_mb, repeats=5), measure_matvec(model)
        _decode_interleaved(model, runs, decode_steps, budget_list, rng)
        after, matvec_after = measure_bandwidth(bandwidth_mb, repeats=5), measure_matvec(model)
        gbps = statistics.median([before["read_gbps"], after["read_gbps"]])
        matvec_ms = round(statistics.median([matvec_before["ms"], matvec_after["ms"]]), 2)
        bandwidths.append({"context": context, "before": before, "after": after, "read_gbps_used": gbps,
                           "matvec_before": matvec_before, "matvec_after": matvec_after, "matvec_ms_used": matvec_ms})
        if progress is not None:
            progress(bandwidths[-1])
        measured = {}
        for name, run in runs.items():
            forward_ms = statistics.median(run["forward_ms"])
            kv = statistics.median(run["kv_bytes"])
            floor_ms = 1000 * (weights + kv) / (gbps * 1e9)
            measured[name] = (forward_ms, floor_ms)
            row = {"context": context, "cache": name, "ms_per_token": round(forward_ms, 2), "read_gbps": gbps,
                   "weight_bytes": weights, "kv_bytes": int(kv), "floor_bytes": int(weights + kv),
                   "floor_ms": round(floor_ms, 2),
                   "roofline_fraction": float(f"{floor_ms / forward_ms:.3g}"),  # 3 significant digits: never 0
                   "matvec_ms": matvec_ms, "matvec_fraction": round(matvec_ms / forward_ms, 3)}
            if name == "budgeted":
                row["budget"], row["budget_blocks_per_layer"] = budget, budget_list[0]
                row["decision_ms"] = round(statistics.median(
                    [step - forward for step, forward in zip(run["step_ms"], run["forward_ms"], strict=True)]), 3)
                row["ratio_to_full"] = round(forward_ms / measured["full"][0], 3)
                row["floor_ratio_to_full"] = round(floor_ms / measured["full"][1], 3)
            rows.append(row)
            if progress is not None:
                progress(row)
            run["cache"].close()
    return {"bandwidth": bandwidths, "weight_bytes": weights, "decode_steps": decode_steps,
            "threads": torch.get_num_threads(), "rows": rows}
