"""H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048): heavy hitters + a recent window.

The rule, as in the official HF simulation (``LlamaAttention_heavy_hitter``, ``utils_hh/modify_llama.py``): a
token's score is the attention it has received, **summed** over every query so far (``current_scores_sum``,
not normalised: a token seen by more queries can gather more); whenever the cache is over budget it keeps the
``recent_budget`` most recent tokens and the ``heavy_budget`` highest-scoring others. Eviction is greedy: an
evicted token is never brought back. The official scripts use ``heavy_ratio = recent_ratio = 0.1`` of the
prompt ("20% heavy hitters"): a 50:50 split of the cache between heavy hitters and recent tokens.

Checked against the paper for this issue: both the unnormalised sum and the 50:50 split are H2O's own. The
normalised variant (attention divided by the number of queries that could see the token) is kvpress's
``ObservedAttentionPress``, kvgym's ``observed_attention``.

On blocks:

- score: ``view.mass("acc", aggregation)``, the attention a block's tokens received, summed over every counted
  query that saw the block (every prompt query with the runner's 64-token chunks, each decode query),
  averaged over query heads (``aggregation = "mean"``; ``"max"`` keeps a block any single head needs);
- budgets: the paper sizes both parts from the prompt. Here the layer's block budget is the total and the
  two ratios only split it: the recent window is the ``round(budget * recent_ratio / (heavy_ratio +
  recent_ratio))`` newest blocks (at least 1). The newest block is only partly filled, so a window of ``r``
  blocks holds between ``16 (r - 1) + 1`` and ``16 r`` tokens. The heavy part is the rest of the budget. It
  includes the pinned sink block, which H2O would normally keep anyway for its attention;
- the controller evicts the lowest-scoring device blocks outside the recent window. It never prefetches.

Decision points: the same rule at every one (``prefill`` chunks, ``compress``, ``question``, ``decode``): H2O is
a streaming method, and at ``compress`` its accumulated score covers every prompt query (KVCache-Factory's
one-shot H2O).

GQA: the paper scores each head on its own. The cache keeps one block table per layer (per-KV-head selection
is out of scope), so a block has one score per layer and all KV heads evict the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.baselines.base import AGGREGATIONS, check_choice, evict_lowest
from cache.controller import CacheView, Decision


@dataclass
class H2O:
    """H2O: heavy hitters by accumulated attention plus a recent window (module docstring)."""
    heavy_ratio: float = 0.1  # share of the budget for heavy hitters; official default 0.1 of the prompt
    recent_ratio: float = 0.1  # share for the recent window; official default 0.1 of the prompt
    aggregation: str = "mean"  # over query heads: "mean" or "max"

    def __post_init__(self):
        if self.heavy_ratio < 0 or self.recent_ratio < 0 or self.heavy_ratio + self.recent_ratio <= 0:
            raise ValueError(f"H2O: ratios must be >= 0 with a positive sum, got heavy_ratio={self.heavy_ratio}, "
                             f"recent_ratio={self.recent_ratio}")
        check_choice("H2O", "aggregation", self.aggregation, AGGREGATIONS)

    def recent_window(self, budget: int) -> int:
        """Blocks in the recent window for a layer budget of ``budget`` blocks (round half up, at least 1)."""
        share = self.recent_ratio / (self.heavy_ratio + self.recent_ratio)
        return max(int(budget * share + 0.5), 1)

    def decide(self, view: CacheView) -> list[Decision]:
        index = torch.arange(view.num_blocks)
        sinks = view.cache.config.sink_blocks
        recent = torch.zeros(view.num_layers, view.num_blocks, dtype=torch.bool)
        for layer in range(view.num_layers):
            budget = int(view.budget_blocks[layer])
            # the window never crowds out the pinned sink: the budget must stay reachable
            window = min(self.recent_window(budget), max(budget - sinks, 1))
            recent[layer] = index >= view.num_blocks - window
        return evict_lowest(view, view.mass("acc", self.aggregation), protect=recent)
