"""SnapKV (Li et al., NeurIPS 2024, arXiv 2404.14469): keep what the prompt's last queries attend to.

The rule (``FasterDecoding/SnapKV``, ``snapkv_utils.py``): at the end of prefill, each prefix token is scored by
the attention it receives from the observation window (the last ``w`` prompt queries). The scores are smoothed
by a 1-D pooling (stride 1, padding ``kernel // 2``) and the top ``C - w`` tokens are kept, plus the window.
This happens once; the paper lets the cache grow during decoding.

On blocks:

- score: ``last_mass`` of a prefill chunk's forward, i.e. the attention its last ``stats_window`` queries
  (``CacheConfig``, default 64 = the library and kvpress window; the paper's LongBench configs use 32) paid to
  each block. A forward's masses sum to its number of queries, which gives the window size; the window
  blocks are those holding the last ``w`` tokens (a short last chunk gives a shorter window);
- pooling: block masses are not token scores, so each block's mass is spread evenly over its tokens. The
  paper's pooling (kernel 7, maxpool) then runs over the prefix tokens, the window excluded as in the
  paper, and each block's pooled token scores are summed again. A block keeps its own mass, plus up to
  ``kernel // 2`` tokens' worth of a heavier neighbour's density at each edge: a weak block next to a heavy
  one can outrank an isolated block of similar mass. (Pooling whole blocks with ``ceil(7 / 16) = 1`` block
  would change nothing; a 3-block kernel would let a neighbour lend all 16 of its tokens, not 3);
- chunked prefill: the runner enforces the budget after every prefill chunk, so a prompt longer than the
  budget sheds blocks as it streams in. The rule runs after each chunk with that chunk's window; after the
  last chunk that window is SnapKV's. Evicted blocks are never recalled;
- decoding: the budget must still hold while the cache grows. This controller evicts prompt blocks in order
  of their score at the end of prefill (lowest first) and keeps the window and the generated blocks as a
  growing window. Only when no prompt block is left (the sink aside) do these go, oldest first. A
  one-token last prefill chunk cannot be told apart from a decode step (both have one query), so it is
  treated as one.

GQA: SnapKV scores each head (kvpress: each KV head, group-averaged). The cache keeps one block table per
layer, so a block's score is the attention averaged over all the layer's query heads, and all KV heads evict
the same blocks.

State: the prefill scores live in the controller. A new run is detected when ``seen`` or the number of blocks
goes down, or when the view comes from another cache object; the state is then cleared.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from agents.baselines.base import evict, excess_blocks, lowest_scoring, recent_blocks
from cache.controller import CacheView, Decision


def pool_block_scores(mass: torch.Tensor, num_tokens: torch.Tensor, block_size: int, kernel_size: int,
                      pooling: str) -> torch.Tensor:
    """``[L, P]`` pooled scores of ``P`` consecutive blocks. Each block's ``mass`` is spread evenly over its
    ``num_tokens`` tokens, the tokens are pooled with SnapKV's 1-D pooling (stride 1, padding
    ``kernel_size // 2``), and the pooled token scores are summed per block again."""
    layers, blocks = mass.shape
    if blocks == 0:  # the window covers every block
        return mass.clone()
    valid = torch.arange(block_size) < num_tokens[..., None]  # [L, P, block_size]
    density = (mass / num_tokens.clamp(min=1))[..., None].expand(layers, blocks, block_size)
    # absent token slots: never the max; count as padding in the average
    tokens = density.masked_fill(~valid, float("-inf") if pooling == "maxpool" else 0.0)
    pool = F.max_pool1d if pooling == "maxpool" else F.avg_pool1d
    pooled = pool(tokens.reshape(layers, 1, -1), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.reshape(layers, blocks, block_size).masked_fill(~valid, 0.0).sum(dim=-1)


@dataclass
class SnapKV:
    kernel_size: int = 7  # tokens; paper LongBench configs (ablation_c*_w32_k7_maxpool.json)
    pooling: str = "maxpool"  # "maxpool" (paper configs) or "avgpool" (library and kvpress default)
    _scores: torch.Tensor | None = field(default=None, init=False, repr=False)  # [L, P] pooled prefix scores
    _window_start: int = field(default=0, init=False, repr=False)  # first block of the observation window
    _seen: int = field(default=0, init=False, repr=False)
    _blocks: int = field(default=0, init=False, repr=False)
    _cache: weakref.ref | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"SnapKV: kernel_size must be odd and >= 1 (same-length pooling), got {self.kernel_size}")
        if self.pooling not in ("maxpool", "avgpool"):
            raise ValueError(f"SnapKV: pooling must be 'maxpool' or 'avgpool', got {self.pooling!r}")

    def _track_run(self, view: CacheView) -> None:
        same_cache = self._cache is not None and self._cache() is view.cache
        if not same_cache or view.seen < self._seen or view.num_blocks < self._blocks:
            self._scores, self._window_start = None, 0
        self._cache, self._seen, self._blocks = weakref.ref(view.cache), view.seen, view.num_blocks

    def _observe_prefill(self, view: CacheView, queries: int) -> None:
        """Score the prefix blocks by the attention of the latest forward's ``queries`` window queries."""
        start = int(torch.nonzero(recent_blocks(view, queries)).min())
        self._window_start = start
        self._scores = pool_block_scores(view.last_mass[:, :start], view.num_tokens[:, :start],
                                         view.cache.block_size, self.kernel_size, self.pooling)

    def priority(self, view: CacheView) -> torch.Tensor:
        """``[L, N]``: eviction order, lowest first. The prefix blocks come first, by pooled score. The window
        and the generated blocks follow, oldest first, ranked above every prefix score."""
        scores = torch.zeros(view.num_layers, view.num_blocks)
        if self._scores is not None:
            scores[:, : self._scores.shape[1]] = self._scores
        index = torch.arange(view.num_blocks)
        kept = index >= self._window_start
        return torch.where(kept, scores.amax(dim=1, keepdim=True) + 1 + index, scores)

    def decide(self, view: CacheView) -> list[Decision]:
        self._track_run(view)
        queries = round(float(view.last_mass.sum(dim=1).max()))  # every query hands out mass 1
        if queries > 1:  # a prefill chunk: select again with its observation window
            self._observe_prefill(view, queries)
        priority = self.priority(view)
        return [d for layer in range(view.num_layers)
                for d in evict(layer, lowest_scoring(view, layer, priority[layer], excess_blocks(view, layer)))]
