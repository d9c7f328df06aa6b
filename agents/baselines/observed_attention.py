"""ObservedAttention: kvpress's normalised H2O (``ObservedAttentionPress``, NVIDIA kvpress 0.5.5; related to H2O,
Zhang et al., NeurIPS 2023, arXiv 2306.14048).

The rule (kvpress): a token's score is the attention it received from every prompt query, divided by the
number of queries that could see it (``Σ_i A_ij / (n − j)``: its mean attention, so early tokens do not win by
sitting longer, as they do in H2O's plain sum), averaged over the query heads of each KV group; the lowest
scores are pruned once, at the end of the prefill, with no protected window. kvpress needs eager attention
for it (the full ``n × n`` matrix).

On blocks: a block's score is its accumulated attention per query head divided by the mean number of counted
queries that could see its tokens (``CacheView.observed_mass`` per head, from the same attention pass, no eager
attention), then ``aggregation`` over query heads (``"mean"``: kvpress's group mean, here over all of the
layer's heads; ``"max"`` keeps a block any single head needs). The block's token scores are summed before the
division, so at block size 1 this is kvpress's score exactly.

Decision points: at ``compress`` (one-shot) every prompt query is counted (the runner prefills in 64-token
chunks, each fully recorded), which is kvpress's press. At every other decision (streaming ``prefill``,
``question``, ``decode``) the same rule runs over the queries counted so far, evicting the lowest-scoring
device blocks until the layer fits its budget; queries that arrived while a block was away are not in its
count (it could not be seen), so the normalisation stays a mean over the queries that saw it.

Deviations: blocks of 16 tokens, not tokens; one block set per layer for all KV heads (kvpress keeps the same
number per KV head, each its own tokens; per-KV-head selection is out of scope).
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.baselines.base import AGGREGATIONS, check_choice, evict_lowest, observed_mass_heads, over_heads
from cache.controller import CacheView, Decision


@dataclass
class ObservedAttention:
    """ObservedAttention (kvpress): accumulated attention over the queries that could see each block."""
    aggregation: str = "mean"  # over query heads: "mean" (kvpress's group mean) or "max"

    def __post_init__(self):
        check_choice("ObservedAttention", "aggregation", self.aggregation, AGGREGATIONS)

    def decide(self, view: CacheView) -> list[Decision]:
        return evict_lowest(view, over_heads(observed_mass_heads(view), self.aggregation))
