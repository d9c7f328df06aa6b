"""Quest (Tang et al., ICML 2024, arXiv 2406.10774; reference code github.com/mit-han-lab/Quest,
``evaluation/quest_attention.py``): query-aware page selection by an upper bound of the attention logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.baselines.base import make_resident
from cache.controller import CacheView, Decision, page_bounds
from cache.tiers import Tier


@dataclass
class Quest:
    """Quest as an offloading controller: every page (= one 16-token block, the paper's ``page_size``) is kept,
    and the device holds the pages Quest would read for the latest query.

    Rules, per layer, with the device budget ``budget_blocks[layer]`` pages, by decision point (``view.phase``):

    - ``prefill`` (streaming): the paper's prefill is dense, with no selection. The budget must hold while the
      prompt streams in, so the device keeps the newest pages and the oldest are offloaded to the host (then
      disk) tier, as dense as the budget allows; no page is chosen by a query yet, none is prefetched.
    - ``compress`` (one-shot), ``question`` (streaming: the question has been read) and ``decode``: selection.
      Page score ``U(page) = Σ_c max(q_c·M_c, q_c·m_c)`` from ``last_query`` (at ``question`` and ``compress`` the
      last prompt query read, i.e. the question's in ``oneshot-question`` and streaming; in decoding the
      current one) and the page's channel-wise ``key_max``/``key_min`` (post-RoPE), per query head against the KV
      head its group reads (``repeat_kv``, as in the reference code), then combined over query heads by
      ``head_reduction``: ``max`` (default: a page critical to any head counts, the nearest single ranking to
      the paper's per-head top-K, whose union is what a shared page set must hold) or ``sum``. The device
      then holds the cache's pinned blocks (the newest page, which the Quest kernel always reads, and the
      sink block 0) and the pages with the largest ``U`` until the budget is full (the paper's
      top-``token_budget / page_size``; ties to the older page): selected host/disk pages are prefetched,
      unselected device pages are offloaded. In the one-shot protocols with a growing cache ``compress`` is the
      only decision, so the selection is made once, with the last prompt query.
    - Offloading: Quest never drops; evictions go to the host (then disk) tier, so give the cache
      ``CacheConfig(host_blocks=...)`` enough room; if every tier is full the cache drops the page, and dropped
      pages are never selected again.

    Deviations: the paper runs layers 0 and 1 dense; here every layer must meet its budget, so all layers
    select (a per-layer budget list with a full budget for them reproduces the dense layers). The paper selects
    per query head; the cache keeps one page set per layer (per-KV-head selection is out of scope), hence
    ``head_reduction``. The paper selects at every decode step; here at each decision point
    (``decide_every`` steps, or when a new page takes a layer over budget).

    Parameters
    ----------
    head_reduction : str
        ``"max"`` or ``"sum"`` of the per-query-head bounds (the paper selects per head; one set per layer here).
    queries : str
        ``"last"`` (the paper: the latest query's bounds) or ``"window"`` (not in the paper: the latest forward's
        counted queries vote, SnapKV-style, each by the softmax of its bounds over the layer's pages;
        ``CacheView.window_bound_share``). In streaming the question's decision point then reads the whole
        question, not only its last token. ``"exact"`` (not Quest: the bound replaced by what it bounds) votes
        with the window's exact attention over every live page, offloaded pages scored where they lie
        (``CacheView.window_attention_share``): how far Quest's bound is from the scores it stands for.
    """

    head_reduction: str = "max"
    queries: str = "last"

    def __post_init__(self):
        if self.head_reduction not in ("max", "sum"):
            raise ValueError(f"quest head_reduction: expected 'max' or 'sum', got {self.head_reduction!r}")
        if self.queries not in ("last", "window", "exact"):
            raise ValueError(f"quest queries: expected 'last', 'window' or 'exact', got {self.queries!r}")

    def decide(self, view: CacheView) -> list[Decision]:
        if view.phase == "prefill":
            return self._keep_newest(view)
        if view.last_query is None or view.key_max is None:
            return []
        if self.queries == "exact":
            bounds = view.window_attention_share  # [L, N, heads]
        elif self.queries == "window":
            bounds = view.window_bound_share  # [L, N, heads]
        else:
            bounds = page_bounds(view.last_query, view.key_min, view.key_max)  # [L, N, heads]
        scores = bounds.amax(dim=-1) if self.head_reduction == "max" else bounds.sum(dim=-1)
        decisions = []
        for layer in range(view.num_layers):
            pages = torch.nonzero(view.tier[layer] != Tier.DROPPED).flatten()
            ranked = pages[torch.sort(-scores[layer, pages], stable=True).indices]
            decisions += make_resident(view, layer, ranked)
        return decisions

    @staticmethod
    def _keep_newest(view: CacheView) -> list[Decision]:
        """The dense-as-possible prefill: each layer keeps its newest device pages, the oldest are offloaded."""
        decisions = []
        for layer in range(view.num_layers):
            newest_first = torch.nonzero(view.tier[layer] == Tier.DEVICE).flatten().flip(0)
            decisions += make_resident(view, layer, newest_first)
        return decisions
