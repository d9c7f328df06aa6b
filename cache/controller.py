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

from cache.paged_cache import CacheOperationError, PagedKVCache
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
    """A read-only snapshot of the cache for a controller. Tensors are ``[L, N]`` with ``N`` the number of
    logical blocks in use (``L`` layers); block ``b`` covers positions ``first_position[b]`` onwards.

    - ``tier``: int8 ``Tier`` values; ``num_tokens``: int32; ``pinned``: bool;
    - ``acc_mass``, ``recent_mass``: float32 attention statistics; ``last_attended``: int64 (-1 = never);
    - ``budget_blocks``: int64 ``[L]`` device budget of each layer; ``seen``: tokens seen.
    ``mean_key`` (``[L, N, kv_heads, head_dim]``) is computed on first access.
    """

    cache: PagedKVCache
    seen: int
    tier: torch.Tensor
    first_position: torch.Tensor
    num_tokens: torch.Tensor
    pinned: torch.Tensor
    acc_mass: torch.Tensor
    recent_mass: torch.Tensor
    last_attended: torch.Tensor
    budget_blocks: torch.Tensor

    @classmethod
    def from_cache(cls, cache: PagedKVCache, budget_blocks: list[int]) -> CacheView:
        n = cache.num_logical_blocks()
        tables, stats = cache.tables, cache.stats
        pinned = torch.stack([cache.pinned_mask(layer) for layer in range(cache.num_layers)])
        return cls(
            cache=cache,
            seen=cache.seen,
            tier=tables.tier[:, :n].clone(),
            first_position=tables.first_position(0),
            num_tokens=tables.num_tokens[:, :n].clone(),
            pinned=pinned,
            acc_mass=stats.acc_mass[:, :n].clone(),
            recent_mass=stats.recent_mass[:, :n].clone(),
            last_attended=stats.last_attended[:, :n].clone(),
            budget_blocks=torch.tensor(budget_blocks, dtype=torch.int64),
        )

    @property
    def num_layers(self) -> int:
        return self.tier.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.tier.shape[1]

    @cached_property
    def mean_key(self) -> torch.Tensor | None:
        n = self.num_blocks
        self.cache.refresh_key_stats()
        keys = self.cache.stats.mean_key(self.cache.tables.num_tokens[:, :n])
        return None if keys is None else keys[:, :n]

    def device_blocks(self) -> torch.Tensor:
        """``[L]`` number of blocks on the device per layer."""
        return (self.tier == Tier.DEVICE).sum(dim=1)


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
        if op == Op.EVICT:
            cache.evict(decision.layer, decision.block)
        elif op == Op.PREFETCH:
            cache.prefetch(decision.layer, decision.block)
        elif op == Op.MERGE:
            raise CacheOperationError("merge is not implemented yet (planned with the tier operations)")
        counts[op.name.lower()] += 1
    return counts
