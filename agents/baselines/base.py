"""Helpers shared by the baselines: picking blocks to evict or fetch by a score, within each layer's budget."""

from __future__ import annotations

import torch

from cache.controller import CacheView, Decision, Op
from cache.tiers import Tier


def evictable(view: CacheView, layer: int) -> torch.Tensor:
    """Bool ``[N]``: device blocks of ``layer`` that may be evicted (not pinned)."""
    return (view.tier[layer] == Tier.DEVICE) & ~view.pinned[layer]


def excess_blocks(view: CacheView, layer: int, budget: int | None = None) -> int:
    """How many device blocks ``layer`` holds above ``budget`` (default: the view's budget for the layer)."""
    budget = int(view.budget_blocks[layer]) if budget is None else budget
    return max(int((view.tier[layer] == Tier.DEVICE).sum()) - budget, 0)


def lowest_scoring(view: CacheView, layer: int, scores: torch.Tensor, count: int,
                   protect: torch.Tensor | None = None) -> list[int]:
    """The ``count`` evictable blocks of ``layer`` with the lowest ``scores`` (ties: oldest first), skipping
    blocks where ``protect`` is True."""
    if count <= 0:
        return []
    candidates = evictable(view, layer)
    if protect is not None:
        candidates &= ~protect
    blocks = torch.nonzero(candidates).flatten()
    order = torch.sort(scores[blocks].float(), stable=True).indices
    return blocks[order][:count].tolist()


def evict(layer: int, blocks: list[int], op: Op = Op.EVICT) -> list[Decision]:
    return [Decision(layer, block, op) for block in blocks]


def recent_blocks(view: CacheView, recent_tokens: int) -> torch.Tensor:
    """Bool ``[N]``: blocks that hold any of the last ``recent_tokens`` positions."""
    last_position = view.first_position + view.num_tokens.max(dim=0).values - 1
    return last_position >= view.seen - recent_tokens


def make_resident(view: CacheView, layer: int, priority: list[int] | torch.Tensor) -> list[Decision]:
    """Decisions that make ``layer``'s device set its pinned blocks plus the first blocks of ``priority`` that fit
    in the layer's budget (dropped blocks and repeats skipped): evict every other device block, prefetch the
    chosen host/disk ones.

    Order: the prefetches that fit in the device pool's free slots first (each frees a host slot, so an eviction
    that follows lands on the host instead of being dropped when the host is full), then the evictions, then the
    prefetches that need the room those free.
    """
    tier = view.tier[layer].tolist()
    chosen = dict.fromkeys(torch.nonzero(view.pinned[layer]).flatten().tolist())  # an ordered set
    budget = int(view.budget_blocks[layer])
    for block in priority.tolist() if isinstance(priority, torch.Tensor) else priority:
        if len(chosen) >= budget:
            break
        if tier[block] != Tier.DROPPED:
            chosen.setdefault(block)
    evictions = [block for block, where in enumerate(tier) if where == Tier.DEVICE and block not in chosen]
    prefetches = [block for block in chosen if tier[block] in (Tier.HOST, Tier.DISK)]
    free = int(view.device_free[layer])
    return (evict(layer, prefetches[:free], Op.PREFETCH) + evict(layer, evictions)
            + evict(layer, prefetches[free:], Op.PREFETCH))
