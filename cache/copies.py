"""Copies of a cache's blocks for side computations, and the question's re-read.

- ``resident_copy``: a fresh ``PagedKVCache`` holding a copy of each layer's device tokens (or of a chosen set of
  blocks, read where they lie), packed in position order, on which a model can run without touching the cache:
  KVzip's reconstruction, the draft of ``agents.baselines.lookahead``, the re-read below.
- ``reread_tokens``: the question's re-read (the runner's ``question_reread``). A streamed question is encoded while
  only the device blocks of its time are attended, so its keys, values and queries miss whatever the prefill sent
  to the host, the needle included. At the question's decision point the re-read encodes the question's tokens
  again on a copy of **every live block** (device and host, read where they lie: host-side attention, as
  attention-offloading systems compute it) and writes their keys and values back in place, so the question reads
  the whole context before the decision and the answer; the decision then sees the re-encoded queries. The
  context's own keys and values stay as streamed. Cost: one forward of the question's tokens over the whole
  context, reading every off-device block once (counted in ``bytes_moved`` as ``host->host-attention``).
  With ``attention``, the re-read's exact attention to every live block (host blocks included) also replaces the
  latest forward's statistics (``last_mass``, ``last_mass_heads``, ``last_query_heads``), which the streamed
  question could only give its device blocks: the decision then sees what a one-shot question sees.
"""

from __future__ import annotations

import torch

from cache.paged_cache import CacheConfig, PagedKVCache
from cache.tiers import Tier

COPY_WINDOW = 128  # queries a copy records per forward (its ``stats_window``): KVzip's pieces, a question


def resident_copy(view, extra_tokens: int, drop_newest: int = 0,
                  chosen: torch.Tensor | None = None) -> tuple[PagedKVCache, list[torch.Tensor]]:
    """A fresh cache holding a copy of each layer's device tokens of ``view`` (a ``CacheView``; packed in position
    order; the newest ``drop_newest`` tokens left out) and room for ``extra_tokens`` more, recording every query of
    forwards of up to ``COPY_WINDOW`` tokens (``stats_window``) and each block's largest single-query attention; and
    each layer's copied blocks, whose ``i``-th is the copy's block ``i``. ``chosen`` (``[L, N]`` bool): copy these
    blocks instead, read where they lie (a device set being considered; it must hold each layer's newest block)."""
    source, bs = view.cache, view.cache.block_size
    config = CacheConfig(block_size=bs, max_tokens=view.seen + extra_tokens, stats_window=COPY_WINDOW,
                         track_query_max=True, sink_blocks=source.config.sink_blocks)
    copy = PagedKVCache(source.model_config, config)
    resident = []
    for layer in range(view.num_layers):
        blocks = torch.nonzero(view.tier[layer] == Tier.DEVICE if chosen is None else chosen[layer]).flatten()
        counts = view.num_tokens[layer, blocks]
        if bool((counts[:-1] != bs).any()):
            raise ValueError(f"copy: layer {layer} has a partly filled block before its newest one among those copied")
        pool = source.device_pool(layer)
        valid = (torch.arange(bs)[None] < counts[:, None]).to(pool.keys.device)
        if chosen is None:  # in place on the device
            physical = source.tables.physical[layer, blocks].to(pool.keys.device)
            keys, values = pool.keys[physical][valid], pool.values[physical][valid]  # [T, kv_heads, dim]
        else:
            keys, values, _ = view.block_tensors(layer, blocks)
            keys, values = keys.to(pool.keys.device)[valid], values.to(pool.keys.device)[valid]
        keys, values = keys[: len(keys) - drop_newest], values[: len(values) - drop_newest]
        copy.update(keys.transpose(0, 1)[None], values.transpose(0, 1)[None], layer)
        resident.append(blocks)
    return copy, resident


@torch.no_grad()
def reread_tokens(view, start: int, attention: bool = False) -> int:
    """Encode ``view``'s tokens ``[start, seen)`` again over every live block and write their keys and values back
    into ``view.cache`` in place (whatever tier holds them); the cache's window queries become the re-encoded ones.
    Tokens of a block some layer dropped cannot be rewritten: the re-read then starts after the last such block (the
    newest block is pinned, never dropped). ``attention``: the re-read's attention to each live block becomes the
    cache's latest-forward statistics (module docstring). Returns the number of tokens re-encoded; the bytes of
    off-device blocks read go to ``bytes_moved``. The view is stale afterwards."""
    cache, model, bs = view.cache, view.model, view.cache.block_size
    first_block = start // bs
    dropped = torch.nonzero(~view.live_blocks[:, first_block : view.num_blocks].all(dim=0)).flatten()
    if len(dropped):
        start = (first_block + int(dropped[-1]) + 1) * bs
    count = view.seen - start
    if model is None or view.token_ids is None or not 0 < count <= COPY_WINDOW:
        raise ValueError(f"reread: tokens {start}..{view.seen} of the cache cannot be re-read (a model, the token "
                         f"ids and 1..{COPY_WINDOW} tokens are needed)")
    live = view.live_blocks
    device = next(model.parameters()).device
    copy, copied = resident_copy(view, count, drop_newest=count, chosen=live)
    ids = view.token_ids.flatten()[start:view.seen].tolist()
    model(input_ids=torch.tensor([ids], device=device), cache=copy, use_cache=True, logits_to_keep=1,
          position_ids=torch.arange(start, view.seen, device=device)[None])
    positions = torch.arange(start, view.seen)
    blocks, offsets = positions // bs, positions % bs
    touched = torch.unique(blocks)
    for layer in range(view.num_layers):
        keys, values = (t[0, :, -count:].transpose(0, 1) for t in copy.resident_keys_values(layer))  # [count, kv, dim]
        tiers, physical = view.tier[layer, blocks], cache.tables.physical[layer, blocks]
        for tier in torch.unique(tiers).tolist():
            here, pool = tiers == tier, cache.pools[layer][Tier(tier)]
            rows, slots = physical[here].to(pool.keys.device), offsets[here].to(pool.keys.device)
            pool.keys[rows, slots] = keys[here.to(keys.device)].to(pool.keys.device, pool.keys.dtype)
            pool.values[rows, slots] = values[here.to(keys.device)].to(pool.values.device, pool.values.dtype)
        cache.layers[layer].mirror_stale = True
        on_device = touched[view.tier[layer, touched] == Tier.DEVICE]
        cache.summarize_keys(layer, on_device)
        cache.window_queries[layer] = copy.window_queries[layer]
        cache.last_query[layer] = copy.last_query[layer]
    if attention:
        _take_attention(cache.stats, copy.stats, copied)
    copy.close()
    count_host_reads(view, live)
    return count


def count_host_reads(view, blocks: torch.Tensor) -> None:
    """Count, in ``bytes_moved`` as ``host->host-attention``, one read of each of ``blocks`` (``[L, N]`` bool) that
    lies off the device: a side computation (the re-read, a draft) read its keys and values where they lie."""
    cache = view.cache
    off_device = int((blocks & (view.tier != Tier.DEVICE)).sum())
    cache.bytes_moved[("host", "host-attention")] += off_device * cache.device_pool(0).bytes_per_block


def _take_attention(stats, copy_stats, copied: list[torch.Tensor]) -> None:
    """The latest forward's statistics of ``stats`` become ``copy_stats``' (a copy whose block ``i`` of a layer is
    ``copied[layer][i]``); blocks not copied (dropped) get none."""
    for name in ("last_mass_heads", "last_query_heads"):
        target, source = getattr(stats, name), getattr(copy_stats, name)
        target.zero_()
        for layer, blocks in enumerate(copied):
            target[layer, :, blocks] = source[layer, :, : len(blocks)]
    stats.last_mass.copy_(stats.last_mass_heads.mean(dim=1))
