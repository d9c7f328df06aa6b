"""PyramidKV (Cai et al., 2024, arXiv 2406.02069; official code ``Zefan-Cai/KVCache-Factory``, ``pyramidkv_utils.py``;
kvpress ``PyramidKVPress``): SnapKV's selection with a budget that shrinks linearly with depth.

The rule: tokens are scored as in SnapKV (observation window of the last ``w = 64`` prompt queries, pooling with
kernel 5, avgpool: KVCache-Factory's and kvpress's defaults) and each layer keeps its own number of them: with
``C`` the mean budget per layer, ``low = C / β``, ``high = 2C − low``, layer ``l`` of ``L`` keeps
``high − l (high − low) / (L − 1)``, ``β = 20``, so the lower layers (diffuse attention) keep the most and the
total is the same as a uniform budget's.

On blocks: ``layer_budgets`` turns the runner's per-layer budget into that pyramid over all layers, in whole
blocks with the same total (largest remainders round up, no layer below the cache's 2 pinned blocks; see
``pyramid_split``); the runner then enforces it, so bytes read match a uniform budget's. Scoring, phases and
decoding are SnapKV's (``agents/baselines/snapkv.py``): the selection runs once at ``compress`` (one-shot), at
``question`` and after each streaming ``prefill`` chunk with that chunk's window; ``decode`` evicts prompt
blocks by their last score first.

Differences from kvpress 0.5.5 and KVCache-Factory, kept on purpose (the paper's pyramid):

- kvpress falls back to plain SnapKV (uniform budgets) whenever ``low < w`` (``not q_len >= max_num >= min_num
  >= window_size``); at 2k tokens and 25% kept (``C`` = 512, ``low`` = 25.6 < 64) its ``pyramidkv`` **is**
  ``snapkv``. Here the pyramid always applies; ``beta=1`` gives the uniform split (kvpress's fallback);
- both clip the top layer to the context (``high ≤ n − w``) and rebalance; the runner hands ``layer_budgets``
  only the budget, not the context, so the top is not clipped: above about half the context (``2C > n``), a top
  layer's budget exceeds its blocks and part of the total goes unspent.

GQA and granularity: blocks of 16 tokens; one block set per layer for all KV heads (kvpress: per KV head; per-KV-
head selection is out of scope; on the peer samples kvpress's per-head selection is what puts its SnapKV, and so
its PyramidKV fallback, at 0.033: per layer it scores 0.300, benchmarks/HISTORY.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.baselines.base import pyramid_split
from agents.baselines.snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """PyramidKV: SnapKV's selection within a pyramid of layer budgets (module docstring)."""
    kernel_size: int = 5  # KVCache-Factory and kvpress default
    pooling: str = "avgpool"  # KVCache-Factory and kvpress default
    beta: float = 20.0  # the pyramid's steepness: the last layer keeps C / β

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"PyramidKV: beta must be >= 1 (1 = uniform budgets), got {self.beta}")

    def layer_budgets(self, budget: list[int]) -> list[int]:
        """The same total over the layers as a linear pyramid, most in layer 0."""
        return pyramid_split(budget, self.beta)
