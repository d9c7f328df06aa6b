"""LRU over blocks, where "use" means receiving at least a share of a query's attention (the InfLLM block
cache convention: `max_cached_block`, `remove_lru_blocks` in InfLLM's context manager).

The cache records, per block, the sequence length when it last received at least ``attended_share`` × the
uniform share (1 / resident blocks) of a forward pass's attention (``CacheView.last_attended``). LRU evicts
the blocks used longest ago; a block never used counts as used when it was written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.baselines.base import evict, excess_blocks, lowest_scoring
from cache.controller import CacheView, Decision


@dataclass
class LRU:
    """Least recently used: evict the blocks attended (or written) longest ago."""
    def decide(self, view: CacheView) -> list[Decision]:
        written = (view.first_position + view.num_tokens.max(dim=0).values)[None].expand_as(view.last_attended)
        last_use = torch.maximum(view.last_attended, written)
        return [d for layer in range(view.num_layers)
                for d in evict(layer, lowest_scoring(view, layer, last_use[layer], excess_blocks(view, layer)))]
