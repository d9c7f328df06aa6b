"""Quest (Tang et al., ICML 2024, arXiv 2406.10774; reference code github.com/mit-han-lab/Quest,
``evaluation/quest_attention.py``): query-aware page selection by an upper bound of the attention logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.baselines.base import make_resident
from cache.controller import CacheView, Decision
from cache.tiers import Tier


def page_bounds(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Quest's criticality ``U = Σ_c max(q_c·M_c, q_c·m_c)`` of every page for every query head.

    ``query`` ``[L, heads, dim]``, ``key_min``/``key_max`` ``[L, N, kv_heads, dim]`` (channel-wise min/max of the
    page's post-RoPE keys) → ``[L, N, heads]``. Query head ``h`` reads KV head ``h // (heads // kv_heads)``
    (``repeat_kv``). Since ``q_c·k_c ≤ max(q_c·M_c, q_c·m_c)`` for every key in the page, ``U ≥ q·k`` for each.
    """
    group = query.shape[1] // key_max.shape[2]
    low = key_min.repeat_interleave(group, dim=2)  # [L, N, heads, dim]
    high = key_max.repeat_interleave(group, dim=2)
    q = query[:, None]  # [L, 1, heads, dim]
    return torch.maximum(q * high, q * low).sum(dim=-1)


@dataclass
class Quest:
    """Quest as an offloading controller: every page (= one 16-token block, the paper's ``page_size``) is kept,
    and the device holds exactly the pages Quest would read for the latest query.

    Rules, per layer, at every decision point, with the device budget ``budget_blocks[layer]`` pages:

    - Page score: ``U(page) = Σ_c max(q_c·M_c, q_c·m_c)`` from ``last_query`` and the page's channel-wise
      ``key_max``/``key_min`` (post-RoPE), per query head against the KV head its group reads (``repeat_kv``, as
      in the reference code), then combined over query heads by ``head_reduction``: ``max`` (default: a page
      critical to any head counts, the nearest single ranking to the paper's per-head top-K, whose union is what
      a shared page set must hold) or ``sum``.
    - Selection: the cache's pinned blocks (the newest page, which the Quest kernel always reads, and the sink
      block 0, which the cache pins) then the pages with the largest ``U`` until the budget is full (the paper's
      top-``token_budget / page_size``); ties go to the older page.
    - Offloading: the device set is made equal to the selection: selected host/disk pages are prefetched,
      unselected device pages are evicted. Quest never drops: evictions go to the host (then disk) tier, so give
      the cache ``CacheConfig(host_blocks=...)`` enough room; if every tier is full the cache drops the page,
      and dropped pages are never selected again.
    - Dense layers: the paper runs layers 0 and 1 dense (and the prefill dense). Here every layer must meet its
      budget, so all layers, and the prefill decision points (with the chunk's last query), use the same rule;
      to reproduce the dense layers give them a full budget with a per-layer budget list, with which the
      selection keeps every page.

    Parameters
    ----------
    head_reduction : str
        ``"max"`` or ``"sum"`` of the per-query-head bounds (the paper selects per head; one set per layer here).
    """

    head_reduction: str = "max"

    def __post_init__(self):
        assert self.head_reduction in ("max", "sum"), f"head_reduction must be 'max' or 'sum', got {self.head_reduction!r}"

    def decide(self, view: CacheView) -> list[Decision]:
        if view.last_query is None or view.key_max is None:
            return []
        bounds = page_bounds(view.last_query, view.key_min, view.key_max)  # [L, N, heads]
        scores = bounds.amax(dim=-1) if self.head_reduction == "max" else bounds.sum(dim=-1)
        decisions = []
        for layer in range(view.num_layers):
            pages = torch.nonzero(view.tier[layer] != Tier.DROPPED).flatten()
            ranked = pages[torch.sort(-scores[layer, pages], stable=True).indices]
            decisions += make_resident(view, layer, ranked)
        return decisions
