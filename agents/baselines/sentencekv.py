"""SentenceKV (Zhu et al., COLM 2025, arXiv 2504.00970; reference code github.com/zzbright1998/SentenceKV,
``models/sentencekv/custom_llama_sentencekv.py``): sentence-level semantic retrieval from an offloaded store."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from agents.baselines.base import AGGREGATIONS, check_choice, make_resident, recent_blocks
from cache.controller import CacheView, Decision
from cache.tiers import Tier


@dataclass
class SentenceKV:
    """SentenceKV on the paged cache: the device holds the sink, the recent window and the blocks of the sentences
    whose mean key best matches the current query summary; every other kept block waits in the host tier
    (evicted to host, prefetched back when its sentence ranks high).

    Rules, per layer, with the device budget ``τ = budget_blocks[layer]`` blocks, by decision point (``view.phase``):

    - Always resident: the blocks holding the first ``start_tokens`` and the last ``recent_tokens`` tokens (the
      reference code's ``start_budget`` / ``recent_budget``). If the budget cannot hold them all: the cache's
      pinned blocks, then the sink, then the recent blocks newest first.
    - Pre-filter, after every prompt chunk (``prefill``, ``compress``, ``question``): the SnapKV-style pre-filter
      at block granularity. A block's score is the attention of the chunk's last ``stats_window`` queries,
      ``view.mass("last", aggregation)``; the reference code keeps the top tokens **per query head** (GQA
      unfolded by ``repeat_kv``), whose union a shared block set approximates best by the max over heads
      (``aggregation = "max"``, default; ``"mean"`` also offered); the 7-wide max-pool is subsumed by the
      16-token blocks. Because the prompt arrives in chunks, the pre-filter streams: each block keeps the score
      of the last window that saw it, and of the blocks not dropped the top ``⌈r·τ⌉`` (sink and recent first)
      stay in the store; the others are forgotten for good. Blocks written while decoding are always kept
      (the reference code indexes each finished sentence). The scores and the forgotten set are per-run
      state, reset when the controller sees a new cache.
    - ``prefill`` (streaming, the question not read yet): the device keeps the highest pre-filter scores up to
      τ; the rest are offloaded.
    - ``compress`` (one-shot) and ``question`` (streaming, the question has been read, before the first answer
      token): **retrieval** with the prompt's last sentence. The query summary is the mean query, per head, of
      the latest chunk's counted tokens after its last sentence end (``view.window_queries``; in streaming and
      ``oneshot-question`` the question or the answer prefix being read, in ``oneshot`` the end of the context):
      the paper's sentence cache ``Q_s`` holds the queries of the sentence in progress, and here that sentence
      is the prompt's last (the reference code's cold start attends every pre-filtered token instead, which
      the budget does not allow).
    - ``decode``: retrieval with the mean decode query of the current sentence (``sentence_query``). Cold start
      (the current sentence has at most ``length_threshold`` decode queries, e.g. right after a sentence end):
      the reference code attends every pre-filtered token (``r·τ``), which the budget does not allow; we keep
      the current device set, evicting only if over budget, lowest latest-query attention first.
    - Retrieval: sentence ``s``'s vector is the mean post-RoPE key of its kept blocks' tokens, per KV head
      (``mean_key`` weighted by ``num_tokens``); a block belongs to the sentence of its first token
      (``sentence_id``). Score = raw dot product with the query summary, per query head against the KV head it
      reads (``repeat_kv``, as in the reference code) and summed over query heads, which equals the
      group-summed query per KV head. Sentences are sorted by score and their blocks (in position order) fill
      the device up to τ: host/disk blocks are prefetched, device blocks not selected are evicted to host. The
      last sentence may be cut, as in the code.
    - Where the blocks go: every eviction goes through the cache's ``EVICT``, which offloads to the host tier (or
      disk) while it has room and drops only when both are full; the cache offers no way to request a drop. So
      the pre-filter's losers are offloaded like the rest, but SentenceKV treats them as dropped: they never
      count in a sentence vector and are never prefetched. Dropped-by-the-cache blocks (``Tier.DROPPED``) are
      skipped.
    - No sentence information (no tokenizer, or no sentence end yet: all ``sentence_id`` 0): every block is its
      own sentence.

    Deviations: blocks of 16 tokens, not tokens; one block set per layer serves all heads (the paper retrieves
    per query head; per-KV-head selection is out of scope); the first two layers are not special.

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
    aggregation : str
        The pre-filter's window attention over query heads: ``"max"`` (the union of per-head selections) or
        ``"mean"``.
    """

    start_tokens: int = 32
    recent_tokens: int = 32
    semantic_factor: float = 2.0
    length_threshold: int = 1
    aggregation: str = "max"
    _cache: weakref.ref | None = field(default=None, init=False, repr=False, compare=False)
    _score: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0), init=False, repr=False, compare=False)
    _forgotten: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool), init=False,
                                     repr=False, compare=False)

    def __post_init__(self):
        assert self.start_tokens >= 0 and self.recent_tokens >= 0, "start_tokens and recent_tokens must be >= 0"
        assert self.semantic_factor >= 1.0, "semantic_factor must be >= 1 (the store holds at least the budget)"
        check_choice("SentenceKV", "aggregation", self.aggregation, AGGREGATIONS)

    def decide(self, view: CacheView) -> list[Decision]:
        if view.mean_key is None:
            return []
        self._track(view)
        sink = torch.nonzero(view.first_position < self.start_tokens).flatten()
        recent = torch.nonzero(recent_blocks(view, self.recent_tokens)).flatten().flip(0)
        protected = torch.cat([sink, recent])
        window_mass = view.mass("last", self.aggregation)
        query = self._query_summary(view)  # [L, heads, dim] or None: rank by the window's attention
        decisions = []
        for layer in range(view.num_layers):
            if view.phase != "decode":  # a prompt chunk was read: its window refreshes the pre-filter
                self._prefilter(view, layer, protected, window_mass[layer])
            if query is None:
                ranked = self._by_score(window_mass[layer], (view.tier[layer] == Tier.DEVICE)
                                        & ~self._forgotten[layer])
            else:
                ranked = self._by_sentence(view, layer, query[layer])
            decisions += make_resident(view, layer, torch.cat([protected, ranked]))
        return decisions

    def _query_summary(self, view: CacheView) -> torch.Tensor | None:
        """The query that retrieves sentences: the question's (the latest chunk's mean query) at ``compress``
        and ``question``, the current sentence's mean decode query while decoding; None in streaming prefill
        and at a decoding cold start."""
        if view.phase in ("compress", "question"):
            window, positions = view.window_queries, view.window_positions
            if window is None:
                return None
            # the current sentence: the window's tokens after its last sentence end (the last token's own aside)
            ends = positions[:-1][view.cache.sentence_end[positions[:-1]]]
            current = positions > int(ends.max()) if ends.numel() else torch.ones_like(positions, dtype=torch.bool)
            return torch.stack([queries[:, current].mean(dim=1) for queries in window])
        if view.phase == "decode" and view.sentence_query is not None and view.sentence_length > self.length_threshold:
            return view.sentence_query
        return None

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

    def _prefilter(self, view: CacheView, layer: int, protected: torch.Tensor, window_mass: torch.Tensor) -> None:
        on_device = view.tier[layer] == Tier.DEVICE
        self._score[layer, on_device] = window_mass[on_device]
        kept = (view.tier[layer] != Tier.DROPPED) & ~self._forgotten[layer]
        ranked = self._by_score(self._score[layer], kept)
        order = [block for block in dict.fromkeys(torch.cat([protected, ranked]).tolist()) if kept[block]]
        keep = math.ceil(self.semantic_factor * int(view.budget_blocks[layer]))
        forget = torch.tensor(order[keep:], dtype=torch.int64)
        self._forgotten[layer, forget[~torch.isin(forget, protected)]] = True

    def _by_sentence(self, view: CacheView, layer: int, query: torch.Tensor) -> torch.Tensor:
        kept = (view.tier[layer] != Tier.DROPPED) & ~self._forgotten[layer]
        sentence = view.sentence_id if int(view.sentence_id.max()) > 0 else torch.arange(view.num_blocks)
        weight = (view.num_tokens[layer] * kept).float()
        kv_heads, dim = view.mean_key.shape[2:]
        sums = torch.zeros(int(sentence.max()) + 1, kv_heads, dim).index_add_(
            0, sentence, view.mean_key[layer] * weight[:, None, None])
        counts = torch.zeros(sums.shape[0]).index_add_(0, sentence, weight)
        vectors = sums / counts.clamp(min=1)[:, None, None]  # [S, kv_heads, dim]
        query = query.reshape(kv_heads, -1, dim).sum(dim=1)  # query heads summed per group
        score = torch.einsum("skd,kd->s", vectors, query)
        return self._by_score(score[sentence], kept)

    @staticmethod
    def _by_score(score: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Blocks where ``candidates`` is True, highest ``score`` first (ties: position order)."""
        blocks = torch.nonzero(candidates).flatten()
        return blocks[torch.sort(-score[blocks].float(), stable=True).indices]
