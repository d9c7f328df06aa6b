"""TOVA, Token Omission Via Attention (Oren et al., 2024, arXiv 2401.06104, "Transformers are Multi-State RNNs").

The rule: at every decode step, once the cache is full, drop the token with the lowest attention weight from the
current query, averaged over all heads of the layer; all heads drop the same position.

On blocks: a block's score is ``last_mass``, the attention the latest query paid to its tokens (summed over
them), averaged over all query heads of the layer. The cache's group averages are averaged again, which is
TOVA's all-heads mean. At each decision the controller evicts the lowest-scoring device blocks until the layer
fits its budget. The newest block is pinned, so the current token is never dropped (kvpress protects the
last token as well). Decisions come every ``decide_every`` decode steps, and whenever a new block takes a
layer over budget. Each one uses only the latest query, not the steps in between. During prefill the latest
forward is a chunk, and the cache records its last ``stats_window`` queries together. TOVA's prefill
decisions therefore use that window's mass, an approximation of the last query alone (kvpress's prefill
variant of TOVA).
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.baselines.base import evict, excess_blocks, lowest_scoring
from cache.controller import CacheView, Decision


@dataclass
class TOVA:
    """No parameters: the paper's only knob is the cache size, which here is the layer budget."""

    def decide(self, view: CacheView) -> list[Decision]:
        return [d for layer in range(view.num_layers)
                for d in evict(layer, lowest_scoring(view, layer, view.last_mass[layer], excess_blocks(view, layer)))]
