"""TOVA, Token Omission Via Attention (Oren et al., 2024, arXiv 2401.06104, "Transformers are Multi-State RNNs").

The rule: once the cache is full, drop the token with the lowest attention weight from the **current query**,
averaged over all heads of the layer; all heads drop the same position. Official code:
``schwartz-lab-NLP/TOVA`` (``tova_cache.py``); kvpress's ``TOVAPress`` (reviewed by a TOVA author) applies the same
rule once at the end of the prefill with the last prompt query, protecting the last token.

On blocks: a block's score is ``view.mass("last_query", aggregation)``, the attention the latest forward's
**last query alone** paid to its tokens (summed over them), averaged over all query heads (``aggregation =
"mean"``, the paper's rule; ``"max"`` keeps a block any single head needs). At each decision the lowest-scoring
device blocks are evicted until the layer fits its budget. The newest block is pinned, so the current token is
never dropped (kvpress protects it too).

Decision points (``view.phase``):

- ``compress`` (one-shot protocols): the last query of the dense prefill, i.e. kvpress's TOVA (in
  ``oneshot-question`` the last prompt token but one, as kvpress's context ends there);
- ``prefill`` (streaming): the last query of the chunk just read. The paper evicts after every token; here
  decisions come after every chunk, each with its chunk's last query only (the queries in between do not vote);
- ``question``: the last query of the question (the token before the last prompt token);
- ``decode``: the current query, every ``decide_every`` steps and whenever a new block takes a layer over
  budget (the paper decides every step).

Deviations: blocks of 16 tokens, not tokens (a block survives on its total mass); one block set per layer, as
in the paper (per-KV-head selection is out of scope and TOVA does not use it).
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.baselines.base import AGGREGATIONS, check_choice, evict_lowest
from cache.controller import CacheView, Decision


@dataclass
class TOVA:
    """The paper's only knob is the cache size, which here is the layer budget."""

    aggregation: str = "mean"  # over query heads: "mean" (paper, kvpress) or "max"

    def __post_init__(self):
        check_choice("TOVA", "aggregation", self.aggregation, AGGREGATIONS)

    def decide(self, view: CacheView) -> list[Decision]:
        return evict_lowest(view, view.mass("last_query", self.aggregation))
