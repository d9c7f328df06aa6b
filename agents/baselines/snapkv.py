"""SnapKV (Li et al., NeurIPS 2024, arXiv 2404.14469): keep what the prompt's last queries attend to.

The rule (``FasterDecoding/SnapKV``, ``snapkv_utils.py``; kvpress ``SnapKVPress``): at the end of the prompt, each
prefix token is scored by the attention it receives from the observation window (the last ``w`` prompt
queries, where the question is), per head. The scores are smoothed by a 1-D pooling (stride 1, padding
``kernel // 2``) and the top ``C - w`` tokens are kept, plus the window. This happens **once**; the paper lets
the cache grow during decoding. Defaults: the paper's LongBench configs use ``w = 32``, kernel 7, maxpool; the
library and kvpress use ``w = 64``, kernel 5, avgpool, and kvpress averages the pooled scores over each KV group.

On blocks:

- window: the latest forward's counted queries (``view.forward_queries``: the cache's ``stats_window``, 64 by
  default = the library's and kvpress's ``w``); the window blocks are those holding the last ``w`` tokens and
  rank above every prefix block;
- score: ``last_mass_heads``, the attention each window query paid to each block's tokens, summed, **per
  query head**; pooled per head (below), then ``aggregation`` over heads (``"mean"``: kvpress's group mean,
  here over all of the layer's heads; ``"max"`` keeps a block any single head needs);
- pooling: block masses are not token scores, so each block's mass is spread evenly over its tokens. The
  pooling (``kernel_size``, ``pooling``) then runs over the prefix tokens, the window excluded as in the
  paper, and each block's pooled token scores are summed again. A block keeps its own mass, plus up to
  ``kernel // 2`` tokens' worth of a heavier neighbour's density at each edge: a weak block next to a heavy
  one can outrank an isolated block of similar mass. At block size 1 this is the paper's pooling exactly.

Decision points (``view.phase``):

- ``compress`` (one-shot protocols): the selection, once, with the end-of-prompt window (in
  ``oneshot-question`` the window holds the question): the paper's SnapKV;
- ``question`` (streaming): the same selection, the window being the question's last chunk, over the blocks
  still on the device;
- ``prefill`` (streaming): the budget must hold while the prompt streams in, before the question exists. The
  same rule runs after every chunk with that chunk's last ``w`` queries as the window (SnapKV applied
  chunk-wise); evicted blocks are never recalled;
- ``decode``: the cache must still fit when the budget is fixed: prompt blocks go in order of their score at
  the last selection (lowest first), then the window and the generated blocks as a growing window, oldest first.

GQA: SnapKV scores each head (kvpress: each KV head, group-averaged). The cache keeps one block table per layer
(per-KV-head selection is out of scope), so all KV heads evict the same blocks. This is the one difference
from kvpress that matters on SmolLM2: on the peer samples (25% kept) kvpress's SnapKV scores 0.033 per KV head
and 0.300 with its scores averaged per layer, which is this controller's figure at block size 1 (benchmarks/HISTORY.md).

State: the last selection's scores live in the controller. A new run is detected when ``seen`` or the number of
blocks goes down, or when the view comes from another cache object; the state is then cleared.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from agents.baselines.base import (
    AGGREGATIONS,
    check_choice,
    evict_lowest,
    over_heads,
    prompt_first_priority,
    recent_blocks,
)
from cache.controller import CacheView, Decision


def pool_block_scores(mass: torch.Tensor, num_tokens: torch.Tensor, block_size: int, kernel_size: int,
                      pooling: str) -> torch.Tensor:
    """``[R, P]`` pooled scores of ``P`` consecutive blocks in each of ``R`` rows. Each block's ``mass`` is spread
    evenly over its ``num_tokens`` tokens, the tokens are pooled with SnapKV's 1-D pooling (stride 1, padding
    ``kernel_size // 2``), and the pooled token scores are summed per block again."""
    rows, blocks = mass.shape
    if blocks == 0:  # the window covers every block
        return mass.clone()
    valid = torch.arange(block_size) < num_tokens[..., None]  # [R, P, block_size]
    density = (mass / num_tokens.clamp(min=1))[..., None].expand(rows, blocks, block_size)
    # absent token slots: never the max; count as padding in the average
    tokens = density.masked_fill(~valid, float("-inf") if pooling == "maxpool" else 0.0)
    pool = F.max_pool1d if pooling == "maxpool" else F.avg_pool1d
    pooled = pool(tokens.reshape(rows, 1, -1), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.reshape(rows, blocks, block_size).masked_fill(~valid, 0.0).sum(dim=-1)


def window_scores(view: CacheView, kernel_size: int, pooling: str, aggregation: str) -> tuple[torch.Tensor, int]:
    """SnapKV's selection scores with the latest forward's counted queries as the observation window:
    ``([L, P] pooled and head-aggregated scores of the prefix blocks, P = the window's first block)``."""
    start = int(torch.nonzero(recent_blocks(view, max(view.forward_queries, 1))).min())
    heads = view.last_mass_heads
    if heads is None or start == 0:
        return torch.zeros(view.num_layers, start), start
    layers, num_heads, _ = heads.shape
    counts = view.num_tokens[:, None, :start].expand(layers, num_heads, start).reshape(-1, start)
    pooled = pool_block_scores(heads[:, :, :start].reshape(-1, start), counts, view.cache.block_size,
                               kernel_size, pooling)
    return over_heads(pooled.reshape(layers, num_heads, start), aggregation), start


@dataclass
class SnapKV:
    """SnapKV: blocks scored by the pooled attention of the latest window of queries (module docstring)."""
    kernel_size: int = 7  # tokens; paper LongBench configs (ablation_c*_w32_k7_maxpool.json)
    pooling: str = "maxpool"  # "maxpool" (paper configs) or "avgpool" (library and kvpress default)
    aggregation: str = "mean"  # over query heads: "mean" (kvpress's group mean) or "max"
    _scores: torch.Tensor | None = field(default=None, init=False, repr=False)  # [L, P] scores of the prefix
    _seen: int = field(default=0, init=False, repr=False)
    _blocks: int = field(default=0, init=False, repr=False)
    _cache: weakref.ref | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"SnapKV: kernel_size must be odd and >= 1 (same-length pooling), got {self.kernel_size}")
        check_choice("SnapKV", "pooling", self.pooling, ("maxpool", "avgpool"))
        check_choice("SnapKV", "aggregation", self.aggregation, AGGREGATIONS)

    def _track_run(self, view: CacheView) -> None:
        same_cache = self._cache is not None and self._cache() is view.cache
        if not same_cache or view.seen < self._seen or view.num_blocks < self._blocks:
            self._scores = None
        self._cache, self._seen, self._blocks = weakref.ref(view.cache), view.seen, view.num_blocks

    def priority(self, view: CacheView) -> torch.Tensor:
        """``[L, N]``: eviction order, lowest first. The prefix blocks of the last selection come first, by
        score; the window and the blocks written since follow, oldest first, above every prefix score."""
        scores = self._scores if self._scores is not None else torch.zeros(view.num_layers, 0)
        return prompt_first_priority(scores, view.num_blocks)

    def decide(self, view: CacheView) -> list[Decision]:
        self._track_run(view)
        if view.phase != "decode":  # prefill chunk, compress or question: select with the latest window
            self._scores, _ = window_scores(view, self.kernel_size, self.pooling, self.aggregation)
        return evict_lowest(view, self.priority(view))
