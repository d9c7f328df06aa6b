"""StreamingLLM (Xiao et al., ICLR 2024, arXiv 2309.17453): attention sinks + a recent window.

Keeps the first ``n_sink`` tokens and the most recent ones, evicting the oldest middle blocks first. In the
paged cache the sink is block-granular: the blocks holding the first ``n_sink`` tokens stay (the cache pins
block 0 anyway), and the recent window is whatever the layer's budget leaves. Positions are not re-rotated
(the "StreamingLLM as eviction" variant used on leaderboards; kept tokens keep their true positions).
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.baselines.base import evict, excess_blocks, lowest_scoring
from cache.controller import CacheView, Decision


@dataclass
class StreamingLLM:
    """StreamingLLM: the attention-sink tokens plus a recent window."""
    n_sink: int = 4  # tokens; official StartRecentKVCache(start_size=4)

    def decide(self, view: CacheView) -> list[Decision]:
        sink = view.first_position < self.n_sink
        age = view.first_position.float()  # lowest = oldest
        decisions = []
        for layer in range(view.num_layers):
            decisions += evict(layer, lowest_scoring(view, layer, age, excess_blocks(view, layer), protect=sink))
        return decisions


@dataclass
class SlidingWindow:
    """FIFO / sliding window: evict the oldest blocks. The cache pins the first block, so unlike a pure
    sliding window the very first tokens stay (that makes it StreamingLLM with a one-block sink)."""

    def decide(self, view: CacheView) -> list[Decision]:
        age = view.first_position.float()
        return [d for layer in range(view.num_layers)
                for d in evict(layer, lowest_scoring(view, layer, age, excess_blocks(view, layer)))]


