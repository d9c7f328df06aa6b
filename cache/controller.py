"""The controller interface: what a cache policy sees (``CacheView``) and what it returns (``Decision``s).

Baselines, the trained PPO policy, the full cache and the oracle all implement ``Controller`` and share
the runner's plumbing. ``EvictOldest`` is the built-in rule that proves eviction runs end to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import Protocol, runtime_checkable

import torch

from cache.paged_cache import PagedKVCache
from cache.tiers import Tier


class Op(IntEnum):
    KEEP = 0
    EVICT = 1
    MERGE = 2
    PREFETCH = 3


@dataclass(frozen=True)
class Decision:
    layer: int
    block: int
    op: Op


@dataclass
class CacheView:
    """A read-only snapshot of the cache for a controller. Per-block tensors are ``[L, N]`` (``L`` layers,
    ``N`` logical blocks in use); block ``b`` covers positions ``first_position[b]`` onward.

    Built eagerly (cheap):

    - ``tier`` (int8 ``Tier``; ``DROPPED`` marks a cache miss: content gone), ``num_tokens``, ``pinned``;
    - ``acc_mass``, ``recent_mass``, ``last_mass`` (float32; see ``BlockStats``), ``last_attended`` (int64,
      tokens seen; -1 = never);
    - ``sentence_id`` ``[N]``: sentence index of the block's first token; ``sentence_boundary`` ``[N]``: the
      block holds a sentence end (from the tokenizer's punctuation tokens, when the runner has a tokenizer);
    - ``budget_blocks`` ``[L]``, ``pressure`` ``[L]`` (device blocks / budget), ``tier_occupancy`` ``[3]``
      (used / capacity of the device, host and disk pools over all layers; 0 for an absent tier),
      ``device_free`` ``[L]`` (free device-pool blocks per layer);
    - ``forward_tokens`` (tokens fed by the latest forward: 1 in a decode step, the chunk size in prefill),
      ``forward_queries`` (queries behind ``last_mass``), ``sentence_length`` (decode steps of the sentence
      being generated, the count behind ``sentence_query``).

    Computed on first access: ``mean_key``, ``key_min``, ``key_max`` (``[L, N, kv_heads, head_dim]``),
    ``last_query`` and ``sentence_query`` (``[L, heads, head_dim]``: the latest query; the mean query of
    the sentence being generated), ``query_summary`` (``[L, kv_heads, head_dim]``), ``query_similarity``
    and ``neighbour_similarity`` (``[L, N]``), ``legal_ops`` (``[L, N, 4]``).
    """

    cache: PagedKVCache
    seen: int
    tier: torch.Tensor
    first_position: torch.Tensor
    num_tokens: torch.Tensor
    pinned: torch.Tensor
    acc_mass: torch.Tensor
    recent_mass: torch.Tensor
    last_mass: torch.Tensor
    last_attended: torch.Tensor
    sentence_id: torch.Tensor
    sentence_boundary: torch.Tensor
    budget_blocks: torch.Tensor
    pressure: torch.Tensor
    tier_occupancy: torch.Tensor
    device_free: torch.Tensor
    forward_tokens: int
    forward_queries: int
    sentence_length: int

    @classmethod
    def from_cache(cls, cache: PagedKVCache, budget_blocks: list[int]) -> CacheView:
        n = cache.num_logical_blocks()
        tables, stats, bs = cache.tables, cache.stats, cache.block_size
        pinned = torch.zeros(cache.num_layers, n, dtype=torch.bool)
        pinned[:, : cache.config.sink_blocks] = True
        pinned[:, n - 1] = True
        ends = cache.sentence_end[: n * bs].view(n, bs)
        sentences_before = torch.cumsum(ends.sum(dim=1), dim=0) - ends.sum(dim=1)
        budget = torch.tensor(budget_blocks, dtype=torch.int64)
        device = torch.tensor([tables.count_in(layer, Tier.DEVICE) for layer in range(cache.num_layers)])
        return cls(
            cache=cache, seen=cache.seen,
            tier=tables.tier[:, :n].clone(),
            first_position=torch.arange(n, dtype=torch.int64) * bs,
            num_tokens=tables.num_tokens[:, :n].clone(),
            pinned=pinned,
            acc_mass=stats.acc_mass[:, :n].clone(),
            recent_mass=stats.recent_mass[:, :n].clone(),
            last_mass=stats.last_mass[:, :n].clone(),
            last_attended=stats.last_attended[:, :n].clone(),
            sentence_id=sentences_before,
            sentence_boundary=ends.any(dim=1),
            budget_blocks=budget,
            pressure=device.float() / budget.clamp(min=1).float(),
            tier_occupancy=cache.tier_occupancy(),
            device_free=torch.tensor([cache.device_pool(layer).allocator.num_free if cache.pools[layer] else 0
                                      for layer in range(cache.num_layers)]),
            forward_tokens=cache.last_forward_tokens,
            forward_queries=cache.last_forward_queries,
            sentence_length=cache.sentence_query_count,
        )

    @property
    def num_layers(self) -> int:
        return self.tier.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.tier.shape[1]

    def device_blocks(self) -> torch.Tensor:
        """``[L]`` number of blocks on the device per layer."""
        return (self.tier == Tier.DEVICE).sum(dim=1)

    def dropped_spans(self, layer: int) -> list[tuple[int, int]]:
        """``(first, last)`` token positions of each run of dropped blocks of ``layer`` (cache misses)."""
        spans, start = [], None
        dropped = (self.tier[layer] == Tier.DROPPED).tolist() + [False]
        for block, is_dropped in enumerate(dropped):
            if is_dropped and start is None:
                start = block
            elif not is_dropped and start is not None:
                spans.append((start * self.cache.block_size, block * self.cache.block_size - 1))
                start = None
        return spans

    def _key_stat(self, name: str) -> torch.Tensor | None:
        self.cache.refresh_key_stats()
        stats = self.cache.stats
        if stats.key_sum is None:
            return None
        n = self.num_blocks
        if name == "mean":
            return stats.mean_key(self.cache.tables.num_tokens)[:, :n]
        return getattr(stats, f"key_{name}")[:, :n].clone()

    @cached_property
    def mean_key(self) -> torch.Tensor | None:
        return self._key_stat("mean")

    @cached_property
    def key_min(self) -> torch.Tensor | None:
        return self._key_stat("min")

    @cached_property
    def key_max(self) -> torch.Tensor | None:
        return self._key_stat("max")

    @cached_property
    def last_query(self) -> torch.Tensor | None:
        """``[L, heads, head_dim]`` the latest query of every layer (None before the first forward)."""
        if any(q is None for q in self.cache.last_query):
            return None
        return torch.stack([q.detach().float().cpu() for q in self.cache.last_query])

    @cached_property
    def sentence_query(self) -> torch.Tensor | None:
        """``[L, heads, head_dim]`` mean query of the decode steps of the sentence being generated (SentenceKV's
        sentence cache); None right after the prompt or a sentence end."""
        sums = self.cache.sentence_query_sum
        if self.cache.sentence_query_count == 0 or any(q is None for q in sums):
            return None
        return torch.stack([q.cpu() for q in sums]) / self.cache.sentence_query_count

    @cached_property
    def query_summary(self) -> torch.Tensor | None:
        """``[L, kv_heads, head_dim]``: the latest query of each layer, averaged over each KV group."""
        if self.mean_key is None or self.last_query is None:
            return None
        num_layers, heads, dim = self.last_query.shape
        return self.last_query.reshape(num_layers, self.mean_key.shape[2], -1, dim).mean(dim=2)

    @cached_property
    def query_similarity(self) -> torch.Tensor:
        """``[L, N]`` cosine similarity of each block's mean key to the current query summary (mean over KV
        heads); zeros before the first attention call."""
        if self.query_summary is None:
            return torch.zeros(self.num_layers, self.num_blocks)
        cosine = torch.nn.functional.cosine_similarity(self.mean_key, self.query_summary[:, None], dim=-1)
        return cosine.mean(dim=-1)

    @cached_property
    def neighbour_similarity(self) -> torch.Tensor:
        """``[L, N]`` cosine similarity of each block's mean key (KV heads concatenated) to the most similar
        other device block of the same layer; -1 when there is none."""
        if self.mean_key is None:
            return torch.full((self.num_layers, self.num_blocks), -1.0)
        keys = torch.nn.functional.normalize(self.mean_key.flatten(2), dim=-1)
        similarity = keys @ keys.transpose(1, 2)  # [L, N, N]
        candidate = (self.tier == Tier.DEVICE)[:, None, :] & ~torch.eye(self.num_blocks, dtype=torch.bool)[None]
        return similarity.masked_fill(~candidate, -1.0).amax(dim=-1)

    @cached_property
    def legal_ops(self) -> torch.Tensor:
        """``[L, N, 4]`` bool, indexed by ``Op``: what the cache would accept for each block now."""
        on_device = self.tier == Tier.DEVICE
        legal = torch.zeros(self.num_layers, self.num_blocks, len(Op), dtype=torch.bool)
        legal[..., Op.KEEP] = True
        legal[..., Op.EVICT] = on_device & ~self.pinned
        legal[..., Op.MERGE] = legal[..., Op.EVICT] & (self.device_blocks() > 1)[:, None]
        legal[..., Op.PREFETCH] = ((self.tier == Tier.HOST) | (self.tier == Tier.DISK)) & (self.device_free > 0)[:, None]
        return legal


@runtime_checkable
class Controller(Protocol):
    """A cache policy. ``decide`` is called at decision points and returns operations to apply in order;
    anything it leaves over budget is evicted afterwards by the cache's fallback rule (and counted)."""

    def decide(self, view: CacheView) -> list[Decision]: ...


class EvictOldest:
    """Built-in rule: on each layer over budget, evict the oldest unpinned device blocks (FIFO)."""

    def decide(self, view: CacheView) -> list[Decision]:
        decisions = []
        over = view.device_blocks() - view.budget_blocks
        for layer in torch.nonzero(over > 0).flatten().tolist():
            evictable = (view.tier[layer] == Tier.DEVICE) & ~view.pinned[layer]
            oldest = torch.nonzero(evictable).flatten()[: int(over[layer])]
            decisions += [Decision(layer, block, Op.EVICT) for block in oldest.tolist()]
        return decisions


def apply_decisions(cache: PagedKVCache, decisions: list[Decision]) -> dict[str, int]:
    """Apply decisions in order; returns counts per operation name."""
    counts = {op.name.lower(): 0 for op in Op}
    for decision in decisions:
        op = Op(decision.op)
        if op == Op.KEEP:
            cache.check_block(decision.layer, decision.block, "keep")
        elif op == Op.EVICT:
            cache.evict(decision.layer, decision.block)
        elif op == Op.PREFETCH:
            cache.prefetch(decision.layer, decision.block)
        elif op == Op.MERGE:
            cache.merge(decision.layer, decision.block)
        counts[op.name.lower()] += 1
    return counts
