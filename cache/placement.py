"""A decision as tensors: the device set every layer holds after it, instead of one ``Decision`` per block.

A ranking controller decides for every block of every layer at once (``cache.ranking.keep_top``); on a 2k-token
cache of 30 layers a compression evicts ~2,900 blocks, and building one Python object per block cost more than
scoring them. A ``Placement`` holds the answer as ``[L, N]`` masks: ``device`` (what stays on or comes to the
device), ``merge`` (which of the device blocks that leave fold into their neighbours instead of being evicted),
and the tiers it was decided against. ``apply_decisions`` applies it (``apply_placement``), and iterating it gives
the equivalent ``Decision`` list, in the order it is applied, for code that wants one.

Order of application, per layer: prefetches into the free device slots, evictions, the merges (one batch over all
layers: each merged block folds into its layer's blocks that stay), then the prefetches that need the room the
evictions freed. The placement is checked whole against the cache before anything changes: it must have been
decided against the cache's current tiers, leave pinned blocks and dropped blocks where they are, and fit each
layer's device pool; a refused placement raises ``CacheOperationError`` and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np

from cache.controller import Decision, Op
from cache.errors import CacheOperationError
from cache.paged_cache import PagedKVCache
from cache.tiers import Tier


@dataclass(frozen=True, eq=False)
class Placement:
    """``device`` ``[L, N]`` bool: the blocks on the device after the decision; ``merge`` ``[L, N]`` bool: device
    blocks that leave by merging (the others that leave are evicted); ``tier`` ``[L, N]`` int8 and ``free``
    ``[L]``: the tiers and free device slots the decision was made against (``CacheView.tier``/``device_free``)."""

    device: np.ndarray
    merge: np.ndarray
    tier: np.ndarray
    free: np.ndarray

    @property
    def leaving(self) -> np.ndarray:
        """``[L, N]`` device blocks that leave (evicted or merged)."""
        return (self.tier == Tier.DEVICE) & ~self.device

    @property
    def arriving(self) -> np.ndarray:
        """``[L, N]`` offloaded blocks that come back (prefetched)."""
        return self.device & (self.tier != Tier.DEVICE)

    def moves(self) -> tuple[list, list, list, list]:
        """The ``(layer, block)`` pairs in the order they are applied: the prefetches into free device slots, the
        evictions, the merges, then the prefetches that need the room the evictions free."""
        leaving, arriving, merging = self.leaving, self.arriving, self.merge & self.leaving
        first, evictions, later = [], [], []
        for layer in np.flatnonzero((leaving | arriving).any(axis=1)).tolist():
            coming = np.flatnonzero(arriving[layer]).tolist()
            into_free = int(self.free[layer])
            first += zip(repeat(layer), coming[:into_free])
            evictions += zip(repeat(layer), np.flatnonzero(leaving[layer] & ~merging[layer]).tolist())
            later += zip(repeat(layer), coming[into_free:])
        return first, evictions, [tuple(pair) for pair in np.argwhere(merging).tolist()], later

    def decisions(self) -> list[Decision]:
        """The same operations as ``Decision``s, in the order ``apply_placement`` performs them."""
        first, evictions, merges, later = self.moves()
        return [Decision(layer, block, op) for pairs, op in ((first, Op.PREFETCH), (evictions, Op.EVICT),
                                                             (merges, Op.MERGE), (later, Op.PREFETCH))
                for layer, block in pairs]

    def __iter__(self):
        return iter(self.decisions())

    def __len__(self) -> int:
        """Blocks moved: evicted, merged or prefetched."""
        return int(self.leaving.sum() + self.arriving.sum())


def check_placement(cache: PagedKVCache, placement: Placement) -> None:
    """Refuse (``CacheOperationError``) a placement the cache cannot apply whole; nothing changes either way."""
    layers, n = cache.num_layers, cache.num_logical_blocks()
    expected = (layers, n)
    for name in ("device", "merge", "tier"):
        shape = np.shape(getattr(placement, name))
        if shape != expected:
            raise CacheOperationError(f"placement: {name} has shape {shape}, the cache has {expected} "
                                      "(layers, logical blocks); decide against the current view")
    tier = cache.tables.tier[:, :n].numpy()
    if not np.array_equal(tier, placement.tier):
        raise CacheOperationError("placement: it was decided against other tiers than the cache holds now "
                                  "(a stale view); decide against the current view")
    leaving, arriving = placement.leaving, placement.arriving
    pinned = np.zeros(expected, bool)
    pinned[:, : cache.config.sink_blocks] = True
    pinned[:, n - 1] = True
    for mask, why in ((leaving & pinned, "pinned blocks (sinks, the newest) must stay on the device"),
                      (placement.device & (tier == Tier.DROPPED), "dropped blocks cannot come back")):
        if mask.any():
            layer, block = np.argwhere(mask)[0].tolist()
            raise CacheOperationError(f"placement: block {block} of layer {layer}: {why}")
    free = np.array([cache.device_pool(layer).allocator.num_free for layer in range(layers)])
    short = arriving.sum(axis=1) > free + leaving.sum(axis=1)
    if short.any():
        layer = int(np.flatnonzero(short)[0])
        raise CacheOperationError(f"placement: layer {layer} brings back {int(arriving[layer].sum())} blocks, but its "
                                  f"device pool has room for {int(free[layer] + leaving[layer].sum())}")
    nowhere = (placement.merge & leaving).any(axis=1) & ~placement.device.any(axis=1)
    if nowhere.any():
        layer = int(np.flatnonzero(nowhere)[0])
        raise CacheOperationError(f"placement: layer {layer} merges blocks but keeps none to merge them into")


def apply_placement(cache: PagedKVCache, placement: Placement) -> dict[str, int]:
    """Apply ``placement`` (module docstring: order and checks); returns counts per operation name."""
    check_placement(cache, placement)
    first, evictions, merges, later = placement.moves()  # free slots as decided: the tiers checked equal
    for layer, block in first:
        cache.prefetch(layer, block)
    for layer, block in evictions:
        cache.evict(layer, block)
    if merges:
        cache.merge_blocks(merges)
    for layer, block in later:
        cache.prefetch(layer, block)
    counts = {op.name.lower(): 0 for op in Op}
    counts.update(prefetch=len(first) + len(later), evict=len(evictions), merge=len(merges))
    return counts
