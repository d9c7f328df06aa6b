"""H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048): heavy hitters + a recent window.

The rule, as in the official HF simulation (``LlamaAttention_heavy_hitter``, ``utils_hh/modify_llama.py``): a
token's score is the attention it has received, summed over every query so far; whenever the cache is over
budget it keeps the ``recent_budget`` most recent tokens and the ``heavy_budget`` highest-scoring others.
Eviction is greedy: an evicted token is never brought back.

On blocks:

- score: ``acc_mass``, the attention a block's tokens received, summed over every query that saw the block
  (each decode query, and each prefill chunk's last ``stats_window`` queries: all of them with the default
  64-token chunks);
- budgets: the paper sizes both parts from the prompt (``heavy_ratio = recent_ratio = 0.1`` of it, 20% in
  all). Here the layer's block budget (the runner's ``budget``) is the total and the two ratios only split it:
  the recent window is the ``round(budget * recent_ratio / (heavy_ratio + recent_ratio))`` newest blocks
  (at least 1). The newest block is only partly filled, so a window of ``r`` blocks holds between
  ``16 (r - 1) + 1`` and ``16 r`` tokens. The heavy part is the rest of the budget. It includes the
  pinned sink block, which H2O would normally keep anyway for its attention;
- the controller evicts the lowest-``acc_mass`` device blocks outside the recent window. It never prefetches.

GQA: the paper scores each head on its own. The cache keeps one block table per layer, so a block has a
single score: the attention averaged over all the layer's query heads (the group averages, averaged again).
All KV heads evict the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.baselines.base import evict, excess_blocks, lowest_scoring
from cache.controller import CacheView, Decision


@dataclass
class H2O:
    heavy_ratio: float = 0.1  # share of the budget for heavy hitters; official default 0.1 of the prompt
    recent_ratio: float = 0.1  # share for the recent window; official default 0.1 of the prompt

    def __post_init__(self):
        if self.heavy_ratio < 0 or self.recent_ratio < 0 or self.heavy_ratio + self.recent_ratio <= 0:
            raise ValueError(f"H2O: ratios must be >= 0 with a positive sum, got heavy_ratio={self.heavy_ratio}, "
                             f"recent_ratio={self.recent_ratio}")

    def recent_window(self, budget: int) -> int:
        """Blocks in the recent window for a layer budget of ``budget`` blocks (round half up, at least 1)."""
        share = self.recent_ratio / (self.heavy_ratio + self.recent_ratio)
        return max(int(budget * share + 0.5), 1)

    def decide(self, view: CacheView) -> list[Decision]:
        index = torch.arange(view.num_blocks)
        sinks = view.cache.config.sink_blocks
        decisions = []
        for layer in range(view.num_layers):
            budget = int(view.budget_blocks[layer])
            # the window never crowds out the pinned sink: the budget must stay reachable
            window = min(self.recent_window(budget), max(budget - sinks, 1))
            recent = index >= view.num_blocks - window
            victims = lowest_scoring(view, layer, view.acc_mass[layer], excess_blocks(view, layer), protect=recent)
            decisions += evict(layer, victims)
        return decisions
