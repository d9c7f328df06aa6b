"""SentenceKV (Zhu et al., COLM 2025, arXiv 2504.00970; reference code github.com/zzbright1998/SentenceKV,
``models/sentencekv/custom_llama_sentencekv.py``): sentence-level semantic retrieval from an offloaded store."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from agents.baselines.base import make_resident, recent_blocks
from cache.controller import CacheView, Decision
from cache.tiers import Tier


@dataclass
class SentenceKV:
    """SentenceKV on the paged cache: the device holds the sink, the recent window and the blocks of the sentences
    whose mean key best matches the mean query of the sentence being generated; every other kept block waits in
    the host tier (evicted to host, prefetched back when its sentence ranks high).

    Rules, per layer, with the device budget ``τ = budget_blocks[layer]`` blocks:

    - Always resident: the blocks holding the first ``start_tokens`` and the last ``recent_tokens`` tokens (the
      reference code's ``start_budget`` / ``recent_budget``). If the budget cannot hold them all: the cache's
      pinned blocks, then the sink, then the recent blocks newest first.
    - Prefill (the latest forward was a multi-token chunk, i.e. ``last_mass`` sums to more than one query): the
      SnapKV-style pre-filter at block granularity. A block's score is its ``last_mass``, the attention of the
      chunk's last ``stats_window`` queries, averaged over query heads (GQA groups included); the 7-wide max-pool
      is subsumed by the 16-token blocks. Because the prompt arrives in chunks, the pre-filter streams: each
      block keeps the score of the last window that saw it, and of the blocks not dropped the top ``⌈r·τ⌉`` (sink
      and recent first) stay in the store; the others are forgotten for good. The device keeps the highest
      scored device blocks up to τ; the rest are evicted. Blocks written while decoding are always kept (the
      reference code indexes each finished sentence). The scores and the forgotten set are per-run state, reset
      when the controller sees a new cache.
    - Where the blocks go: every eviction goes through the cache's ``EVICT``, which offloads to the host tier (or
      disk) while it has room and drops only when both are full; the cache offers no way to request a drop. So
      the pre-filter's losers are offloaded like the rest, but SentenceKV treats them as dropped: they never
      count in a sentence vector and are never prefetched. Kept blocks live on the host (or disk) when not
      selected; dropped-by-the-cache blocks (``Tier.DROPPED``) are skipped.
    - Decode: sentence ``s``'s vector is the mean post-RoPE key of its kept blocks' tokens, per KV head
      (``mean_key`` weighted by ``num_tokens``); a block belongs to the sentence of its first token
      (``sentence_id``). Score = raw dot product with the mean decode query of the current sentence
      (``sentence_query``), per query head against the KV head it reads (``repeat_kv``, as in the reference
      code) and summed over query heads, which equals the group-summed query per KV head. Sentences are sorted by
      score and their blocks (in position order) fill the device up to τ: host/disk blocks are prefetched,
      device blocks not selected are evicted to host. The last sentence may be cut, as in the code.
    - Cold start (the current sentence has at most ``length_threshold`` decode queries, e.g. right after the
      prompt or a sentence end): the reference code attends every pre-filtered token (``r·τ``), which the
      budget does not allow; we keep the current device set, evicting only if over budget, lowest ``last_mass``
      (the latest query's attention) first.
    - No sentence information (no tokenizer, or no sentence end yet: all ``sentence_id`` 0): every block is its
      own sentence.

    One block set per layer serves all heads (the paper retrieves per head); the first two layers are not special.

    Parameters
    ----------
    start_tokens : int
        Leading tokens always attended (``start_budget = 32``).
    recent_tokens : int
        Trailing tokens always attended (``recent_budget = 32``).
    semantic_factor : float
        ``r``: the pre-filter keeps ``r·τ`` tokens' worth of blocks (``RULER/run_ruler.sh --semantic_factor 2``).
    length_threshold : int
        Cold start while the generated sentence has at most this many queries (reference code: 1).
    """

    start_tokens: int = 32
    recent_tokens: int = 32
    semantic_factor: float = 2.0
    length_threshold: int = 1
    _cache: weakref.ref | None = field(default=None, init=False, repr=False, compare=False)
    _score: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0), init=False, repr=False, compare=False)
    _forgotten: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool), init=False,
                                     repr=False, compare=False)

    def __post_init__(self):
        assert self.start_tokens >= 0 and self.recent_tokens >= 0, "start_tokens and recent_tokens must be >= 0"
        assert self.semantic_factor >= 1.0, "semantic_factor must be >= 1 (the store holds at least the budget)"

    def decide(self, view: CacheView) -> list[Decision]:
        if view.mean_key is None:
            return []
        self._track(view)
        sink = torch.nonzero(view.first_position < self.start_tokens).flatten()
        recent = torch.nonzero(recent_blocks(view, self.recent_tokens)).flatten().flip(0)
        protected = torch.cat([sink, recent])
        prefill = round(float(view.last_mass[0].sum())) > 1
        cold = view.sentence_query is None or view.sentence_length <= self.length_threshold
        decisions = []
        for layer in range(view.num_layers):
            if prefill:
                self._prefilter(view, layer, protected)
            if prefill or cold:
                ranked = self._by_score(view.last_mass[layer], (view.tier[layer] == Tier.DEVICE)
                                        & ~self._forgotten[layer])
            else:
                ranked = self._by_sentence(view, layer)
            decisions += make_resident(view, layer, torch.cat([protected, ranked]))
        return decisions

    def _track(self, view: CacheView) -> None:
        """Reset the per-run state on a new cache; grow it with the sequence."""
        if self._cache is None or self._cache() is not view.cache:
            self._cache = weakref.ref(view.cache)
            self._score = torch.zeros(view.num_layers, 0)
            self._forgotten = torch.zeros(view.num_layers, 0, dtype=torch.bool)
        grow = view.num_blocks - self._score.shape[1]
        if grow > 0:
            self._score = torch.nn.functional.pad(self._score, (0, grow))
            self._forgotten = torch.nn.functional.pad(self._forgotten, (0, grow))

    def _prefilter(self, view: CacheView, layer: int, protected: torch.Tensor) -> None:
        on_device = view.tier[layer] == Tier.DEVICE
        self._score[layer, on_device] = view.last_mass[layer, on_device]
        kept = (view.tier[layer] != Tier.DROPPED) & ~self._forgotten[layer]
        ranked = self._by_score(self._score[layer], kept)
        order = [block for block in dict.fromkeys(torch.cat([protected, ranked]).tolist()) if kept[block]]
        keep = math.ceil(self.semantic_factor * int(view.budget_blocks[layer]))
        forget = torch.tensor(order[keep:], dtype=torch.int64)
        self._forgotten[layer, forget[~torch.isin(forget, protected)]] = True

    def _by_sentence(self, view: CacheView, layer: int) -> torch.Tensor:
        kept = (view.tier[layer] != Tier.DROPPED) & ~self._forgotten[layer]
        sentence = view.sentence_id if int(view.sentence_id.max()) > 0 else torch.arange(view.num_blocks)
        weight = (view.num_tokens[layer] * kept).float()
        kv_heads, dim = view.mean_key.shape[2:]
        sums = torch.zeros(int(sentence.max()) + 1, kv_heads, dim).index_add_(
            0, sentence, view.mean_key[layer] * weight[:, None, None])
        counts = torch.zeros(sums.shape[0]).index_add_(0, sentence, weight)
        vectors = sums / counts.clamp(min=1)[:, None, None]  # [S, kv_heads, dim]
        query = view.sentence_query[layer].reshape(kv_heads, -1, dim).sum(dim=1)  # query heads summed per group
        score = torch.einsum("skd,kd->s", vectors, query)
        return self._by_score(score[sentence], kept)

    @staticmethod
    def _by_score(score: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Blocks where ``candidates`` is True, highest ``score`` first (ties: position order)."""
        blocks = torch.nonzero(candidates).flatten()
        return blocks[torch.sort(-score[blocks].float(), stable=True).indices]
