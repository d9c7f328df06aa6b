"""The controller interface: what a cache policy sees (``CacheView``) and what it returns (``Decision``s, or
one ``cache.placement.Placement``: the device set of every layer as masks).

Baselines, the trained PPO policy, the full cache and the oracle all implement ``Controller`` and share
the runner's plumbing. ``EvictOldest`` is the built-in rule that proves eviction runs end to end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

from cache.paged_cache import PagedKVCache
from cache.tiers import Tier

if TYPE_CHECKING:
    from cache.placement import Placement

PHASES = ("prefill", "compress", "question", "decode")


def page_bounds(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Quest's criticality ``U = Σ_c max(q_c·M_c, q_c·m_c)`` of every page for every query head.

    ``query`` ``[L, heads, dim]`` (or ``[L, heads, q, dim]``: several queries), ``key_min``/``key_max``
    ``[L, N, kv_heads, dim]`` (channel-wise min/max of the page's post-RoPE keys) → ``[L, N, heads]`` (or
    ``[L, N, heads, q]``). Query head ``h`` reads KV head ``h // (heads // kv_heads)`` (``repeat_kv``). Since
    ``q_c·k_c ≤ max(q_c·M_c, q_c·m_c)`` for every key in the page, ``U ≥ q·k`` for each.
    Known for offloaded blocks too (their key summaries stay), so it ranks what a prefetch could bring back.
    Computed as two batched products: ``max(q_c·M_c, q_c·m_c) = max(q_c, 0)·M_c + min(q_c, 0)·m_c`` (as ``M ≥ m``).
    """
    one_query = query.dim() == 3
    if one_query:
        query = query[:, :, None]
    num_layers, heads, count, dim = query.shape
    kv_heads = key_max.shape[2]
    group = heads // kv_heads
    # [L, kv, dim, group · q]: each KV head's query heads (and their queries) as the columns of one product
    q = query.reshape(num_layers, kv_heads, group * count, dim).transpose(-1, -2)
    bound = torch.matmul(key_max.transpose(1, 2), q.clamp(min=0))  # [L, kv, N, group · q]
    bound += torch.matmul(key_min.transpose(1, 2), q.clamp(max=0))
    empty = key_max[..., 0] < key_min[..., 0]  # a page without keys (min +inf, max -inf) is unbounded, as max() says
    bound = bound.transpose(1, 2).masked_fill(empty[..., None], float("inf"))  # [L, N, kv, group · q]
    bound = bound.reshape(num_layers, -1, heads, count)
    return bound[..., 0] if one_query else bound


def unit_cosine(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Cosine similarity over the last dim of broadcastable ``a`` and ``b`` (``cosine_similarity``'s value,
    without its slow broadcasting path)."""
    normalize = torch.nn.functional.normalize
    return (normalize(a, dim=-1, eps=eps) * normalize(b, dim=-1, eps=eps)).sum(dim=-1)


class Op(IntEnum):
    """What a decision does to a block: keep it, evict it, merge it into its neighbours, prefetch it."""
    KEEP = 0
    EVICT = 1
    MERGE = 2
    PREFETCH = 3


class Decision(NamedTuple):  # a named tuple: a ranking decision creates thousands of them at once
    """One operation on one block of one layer; an ``EVICT`` with a ``head`` (>= 0) drops only that KV head's view
    of the block (``PagedKVCache.drop_head``: the block goes when its last head does)."""

    layer: int
    block: int
    op: Op
    head: int = -1


@dataclass
class CacheView:
    """A read-only snapshot of the cache for a controller. Per-block tensors are ``[L, N]`` (``L`` layers,
    ``N`` logical blocks in use); block ``b`` covers positions ``first_position[b]`` onward.

    Built eagerly (cheap):

    - ``tier`` (int8 ``Tier``; ``DROPPED`` marks a cache miss: content gone), ``num_tokens``, ``pinned``;
    - ``acc_mass``, ``recent_mass``, ``last_mass`` (float32; see ``BlockStats``), ``last_attended`` (int64,
      tokens seen; -1 = never);
    - ``sentence_id`` ``[N]``: sentence index of the block's first token; ``sentence_boundary`` ``[N]``: the
      block holds a sentence end (from the tokenizer's punctuation tokens, when the runner has a tokenizer);
    - ``budget_blocks`` ``[L]``, ``pressure`` ``[L]`` (device blocks / budget), ``tier_occupancy`` ``[3]``
      (used / capacity of the device, host and disk pools over all layers; 0 for an absent tier),
      ``device_free`` ``[L]`` (free device-pool blocks per layer);
    - ``total_budget``: None when each layer has its own budget (the runner's ``budget_scope="layer"``); with
      ``budget_scope="global"`` (kvpress's ``layerwise=False``) the device budget of all layers together, a
      controller choosing how many blocks each layer keeps, and ``budget_blocks`` is the current allocation
      (each layer's device blocks after the previous decision; at the first decision, the even split);
    - ``forward_tokens`` (tokens fed by the latest forward: 1 in a decode step, the chunk size in prefill),
      ``forward_queries`` (queries behind ``last_mass``), ``sentence_length`` (decode steps of the sentence
      being generated, the count behind ``sentence_query``);
    - ``phase``: where the runner stands (``PHASES``): ``prefill`` (after a chunk of streamed prompt),
      ``compress`` (the one decision of a one-shot protocol, after the dense prefill), ``question`` (the
      question has been read; the first answer token is computed after this decision), ``decode``;
    - ``question_read``: the cache has read past the context (the question, or the answer): False in a
      streamed context's ``prefill`` decisions and in ``oneshot``'s ``compress`` (kvpress's pipeline compresses
      before the question), True in ``oneshot-question``'s; default: False in ``prefill``, else True;
    - ``model`` and ``token_ids`` (``[seen]``: every token fed so far), set by the runner, for controllers
      that run extra forward passes (KVzip's reconstruction); None outside a runner.

    Computed on first access: ``mean_key``, ``key_min``, ``key_max`` (``[L, N, kv_heads, head_dim]``),
    ``last_query`` and ``sentence_query`` (``[L, heads, head_dim]``: the latest query; the mean query of
    the sentence being generated), ``query_summary`` (``[L, kv_heads, head_dim]``), ``query_similarity``
    and ``neighbour_similarity`` (``[L, N]``), ``legal_ops`` (``[L, N, 4]``).

    Per-head attention statistics, computed on first access (``BlockStats``; ``H`` query heads):
    ``acc_mass_heads``, ``last_mass_heads``, ``last_query_heads`` (``[L, H, N]``: accumulated, latest
    forward's window, latest forward's last query alone), ``query_max_heads`` (``[L, H, N]`` or None: the
    largest single-query mass, when the cache tracks it); ``mass(kind, over_heads)`` aggregates any of them
    (``"acc" | "last" | "last_query" | "query_max"``) by ``"mean"`` or ``"max"`` over query heads;
    ``observed_mass`` (``[L, N]``: accumulated mass divided by the mean number of counted queries that could
    see the block's tokens, kvpress's ObservedAttention); ``window_queries`` (per layer ``[H, q, head_dim]``:
    the latest forward's counted queries, post-RoPE) and ``window_positions`` (``[q]``: their positions).
    """

    cache: PagedKVCache
    seen: int
    tier: torch.Tensor
    first_position: torch.Tensor
    num_tokens: torch.Tensor
    pinned: torch.Tensor
    acc_mass: torch.Tensor
    recent_mass: torch.Tensor
    last_mass: torch.Tensor
    last_attended: torch.Tensor
    sentence_id: torch.Tensor
    sentence_boundary: torch.Tensor
    budget_blocks: torch.Tensor
    pressure: torch.Tensor
    tier_occupancy: torch.Tensor
    device_free: torch.Tensor
    forward_tokens: int
    forward_queries: int
    sentence_length: int
    phase: str = "prefill"
    question_read: bool = False
    model: object = None
    token_ids: torch.Tensor | None = None
    total_budget: int | None = None

    @classmethod
    def from_cache(cls, cache: PagedKVCache, budget_blocks: list[int], phase: str = "prefill", model=None,
                   token_ids: torch.Tensor | None = None, question_read: bool | None = None,
                   total_budget: int | None = None) -> CacheView:
        n = cache.num_logical_blocks()
        tables, stats, bs = cache.tables, cache.stats, cache.block_size
        pinned = torch.zeros(cache.num_layers, n, dtype=torch.bool)
        pinned[:, : cache.config.sink_blocks] = True
        pinned[:, n - 1] = True
        ends = cache.sentence_end[: n * bs].view(n, bs)
        sentences_before = torch.cumsum(ends.sum(dim=1), dim=0) - ends.sum(dim=1)
        budget = torch.tensor(budget_blocks, dtype=torch.int64)
        device = torch.tensor([tables.count_in(layer, Tier.DEVICE) for layer in range(cache.num_layers)])
        return cls(
            cache=cache, seen=cache.seen,
            tier=tables.tier[:, :n].clone(),
            first_position=torch.arange(n, dtype=torch.int64) * bs,
            num_tokens=tables.num_tokens[:, :n].clone(),
            pinned=pinned,
            acc_mass=stats.acc_mass[:, :n].clone(),
            recent_mass=stats.recent_mass[:, :n].clone(),
            last_mass=stats.last_mass[:, :n].clone(),
            last_attended=stats.last_attended[:, :n].clone(),
            sentence_id=sentences_before,
            sentence_boundary=ends.any(dim=1),
            budget_blocks=budget,
            pressure=device.float() / budget.clamp(min=1).float(),
            tier_occupancy=cache.tier_occupancy(),
            device_free=torch.tensor([cache.device_pool(layer).allocator.num_free if cache.pools[layer] else 0
                                      for layer in range(cache.num_layers)]),
            forward_tokens=cache.last_forward_tokens,
            forward_queries=cache.last_forward_queries,
            sentence_length=cache.sentence_query_count,
            phase=phase, question_read=phase != "prefill" if question_read is None else bool(question_read),
            model=model, token_ids=token_ids, total_budget=total_budget,
        )

    @property
    def num_layers(self) -> int:
        return self.tier.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.tier.shape[1]

    def device_blocks(self) -> torch.Tensor:
        """``[L]`` number of blocks on the device per layer."""
        return (self.tier == Tier.DEVICE).sum(dim=1)

    def dropped_spans(self, layer: int) -> list[tuple[int, int]]:
        """``(first, last)`` token positions of each run of dropped blocks of ``layer`` (cache misses)."""
        spans, start = [], None
        dropped = (self.tier[layer] == Tier.DROPPED).tolist() + [False]
        for block, is_dropped in enumerate(dropped):
            if is_dropped and start is None:
                start = block
            elif not is_dropped and start is not None:
                spans.append((start * self.cache.block_size, block * self.cache.block_size - 1))
                start = None
        return spans

    def _key_stat(self, name: str) -> torch.Tensor | None:
        self.cache.refresh_key_stats()
        stats = self.cache.stats
        if stats.key_sum is None:
            return None
        n = self.num_blocks
        if name == "mean":
            return stats.mean_key(self.cache.tables.num_tokens)[:, :n]
        return getattr(stats, f"key_{name}")[:, :n].clone()

    @cached_property
    def mean_key(self) -> torch.Tensor | None:
        return self._key_stat("mean")

    @cached_property
    def key_min(self) -> torch.Tensor | None:
        return self._key_stat("min")

    @cached_property
    def key_max(self) -> torch.Tensor | None:
        return self._key_stat("max")

    # ------------------------------------------------------------ attention statistics per head
    def _heads(self, name: str) -> torch.Tensor | None:
        tensor = getattr(self.cache.stats, name)
        return None if tensor is None else tensor[:, :, : self.num_blocks].clone()

    @cached_property
    def acc_mass_heads(self) -> torch.Tensor | None:
        return self._heads("acc_mass_heads")

    @cached_property
    def last_mass_heads(self) -> torch.Tensor | None:
        return self._heads("last_mass_heads")

    @cached_property
    def last_query_heads(self) -> torch.Tensor | None:
        return self._heads("last_query_heads")

    @cached_property
    def query_max_heads(self) -> torch.Tensor | None:
        return self._heads("query_max_heads")

    def mass(self, kind: str = "acc", over_heads: str = "mean") -> torch.Tensor:
        """``[L, N]`` attention mass of ``kind`` (``acc`` accumulated, ``last`` the latest forward's window,
        ``last_query`` its last query alone, ``query_max`` the largest single query) aggregated over query
        heads by ``over_heads`` (``mean`` | ``max``); zeros before the first attention call."""
        if over_heads not in ("mean", "max"):
            raise ValueError(f"over_heads must be 'mean' or 'max', got {over_heads!r}")
        kinds = ("acc", "last", "last_query", "query_max")
        if kind not in kinds:
            raise ValueError(f"mass kind must be one of {kinds}, got {kind!r}")
        heads = getattr(self, f"{kind}_mass_heads" if kind in ("acc", "last") else f"{kind}_heads")
        if heads is None:
            if kind == "query_max" and self.acc_mass_heads is not None:
                raise ValueError("query_max mass: the cache does not track it (CacheConfig.track_query_max)")
            return torch.zeros(self.num_layers, self.num_blocks)
        return heads.mean(dim=1) if over_heads == "mean" else heads.amax(dim=1)

    @cached_property
    def observed_mass(self) -> torch.Tensor:
        observers = self.cache.stats.observers[:, : self.num_blocks] / self.num_tokens.clamp(min=1)
        return self.acc_mass / observers.clamp(min=1.0)

    @cached_property
    def window_queries(self) -> list[torch.Tensor] | None:
        if any(q is None for q in self.cache.window_queries):
            return None
        return [q.detach().float().cpu() for q in self.cache.window_queries]

    @cached_property
    def window_positions(self) -> torch.Tensor | None:
        if self.window_queries is None:
            return None
        q = self.window_queries[0].shape[1]
        return torch.arange(self.seen - q, self.seen)

    @cached_property
    def last_query(self) -> torch.Tensor | None:
        """``[L, heads, head_dim]`` the latest query of every layer (None before the first forward)."""
        if any(q is None for q in self.cache.last_query):
            return None
        return torch.stack([q.detach().float().cpu() for q in self.cache.last_query])

    @cached_property
    def sentence_query(self) -> torch.Tensor | None:
        """``[L, heads, head_dim]`` mean query of the decode steps of the sentence being generated (SentenceKV's
        sentence cache); None right after the prompt or a sentence end."""
        sums = self.cache.sentence_query_sum
        if self.cache.sentence_query_count == 0 or any(q is None for q in sums):
            return None
        return torch.stack([q.cpu() for q in sums]) / self.cache.sentence_query_count

    @cached_property
    def query_summary(self) -> torch.Tensor | None:
        """``[L, kv_heads, head_dim]``: the latest query of each layer, averaged over each KV group."""
        if self.mean_key is None or self.last_query is None:
            return None
        num_layers, heads, dim = self.last_query.shape
        return self.last_query.reshape(num_layers, self.mean_key.shape[2], -1, dim).mean(dim=2)

    @cached_property
    def query_similarity(self) -> torch.Tensor:
        """``[L, N]`` cosine similarity of each block's mean key to the current query summary (mean over KV
        heads); zeros before the first attention call."""
        if self.query_summary is None:
            return torch.zeros(self.num_layers, self.num_blocks)
        unit_query = torch.nn.functional.normalize(self.query_summary[:, None], dim=-1, eps=1e-8)
        return (self.unit_mean_key * unit_query).sum(dim=-1).mean(dim=-1)  # unit_cosine, the keys normalized once

    @cached_property
    def mean_key_norm(self) -> torch.Tensor | None:
        """``[L, N, kv_heads]`` the norm of each block's mean key (Knorm's score, before the sign)."""
        return None if self.mean_key is None else self.mean_key.norm(dim=-1)

    @cached_property
    def unit_mean_key(self) -> torch.Tensor | None:
        """``[L, N, kv_heads, head_dim]`` each block's mean key scaled to unit length (``normalize``'s, eps 1e-8),
        shared by the cosine features."""
        if self.mean_key is None:
            return None
        return self.mean_key / self.mean_key_norm[..., None].clamp_min(1e-8)

    @cached_property
    def page_bound(self) -> torch.Tensor | None:
        """``[L, N, heads]`` Quest's upper bound of the latest query's attention logit on each block
        (``page_bounds``), offloaded blocks included; None before the first attention call."""
        if self.last_query is None or self.key_max is None:
            return None
        return page_bounds(self.last_query, self.key_min, self.key_max)

    @cached_property
    def live_blocks(self) -> torch.Tensor:
        """Bool ``[L, N]``: the blocks that hold tokens and were not dropped (on device or offloaded)."""
        return (self.tier != Tier.DROPPED) & (self.num_tokens > 0)

    @cached_property
    def window_bound_share(self) -> torch.Tensor | None:
        """``[L, N, heads]``: the share of attention each block could draw from the latest forward's counted
        queries (``window_queries``: in streaming, the question's at its decision point), offloaded blocks
        included: each query's Quest bounds (``page_bounds``) as logits (÷ √head_dim), softmax over the layer's
        live blocks, averaged over the queries (SnapKV's window vote, on bounds). None before the first forward."""
        if self.window_queries is None or self.key_max is None:
            return None
        if self.window_queries[0].shape[1] == 1:  # a decode step's window: its one query is the latest one
            bound = self.page_bound[..., None]
        else:
            bound = page_bounds(torch.stack(self.window_queries), self.key_min, self.key_max)  # [L, N, heads, q]
        logits = (bound / self.window_queries[0].shape[-1] ** 0.5).masked_fill(
            ~self.live_blocks[..., None, None], -torch.inf)
        return torch.softmax(logits, dim=1).nan_to_num(0.0).mean(dim=-1)

    @cached_property
    def window_attention_share(self) -> torch.Tensor | None:
        """``[L, N, heads]``: the share of attention each block draws from the latest forward's counted queries
        (``window_queries``), computed exactly over each layer's live blocks wherever they lie: offloaded keys are
        read where they are (host-side scoring, as RetrievalAttention scores offloaded keys on the CPU), not
        moved. Causal; a merged slot counts with its log weight; averaged over the queries. One attention pass of
        the window over the whole cache (decode steps: one query). None before the first forward."""
        if self.window_queries is None:
            return None
        return self.attention_share(self.window_queries, self.seen - self.window_queries[0].shape[1])

    def block_tensors(self, layer: int, blocks: torch.Tensor, values: bool = True) -> tuple[torch.Tensor, ...]:
        """``(keys, values, log_weights)`` of ``layer``'s ``blocks`` (``[n, block_size, kv_heads, …]`` on the CPU),
        each read from its tier's pool where it lies; ``values=False``: values left empty, not read."""
        cache, tiers, physical = self.cache, self.tier[layer, blocks], self.cache.tables.physical[layer, blocks]
        pool = cache.device_pool(layer)
        keys = torch.empty((len(blocks), *pool.keys.shape[1:]), dtype=pool.keys.dtype)
        kept_values, log_weights = torch.empty_like(keys), torch.empty((len(blocks), *pool.log_weights.shape[1:]))
        for tier in torch.unique(tiers).tolist():
            here, pool = tiers == tier, cache.pools[layer][Tier(tier)]
            rows = physical[here].to(pool.keys.device)
            keys[here], log_weights[here] = pool.keys[rows].cpu(), pool.log_weights[rows].cpu()
            if values:
                kept_values[here] = pool.values[rows].cpu()
        return keys, kept_values, log_weights

    def attention_share(self, queries_by_layer: list[torch.Tensor], first_position: int) -> torch.Tensor:
        """``[L, N, heads]``: ``window_attention_share`` for any queries (``[heads, q, dim]`` per layer, post-RoPE,
        at positions ``first_position`` onward), e.g. those of tokens drafted ahead."""
        cache, size = self.cache, self.cache.block_size
        heads, q, dim = queries_by_layer[0].shape
        kv_heads = cache.device_pool(0).keys.shape[2]
        share = torch.zeros(self.num_layers, self.num_blocks, heads)
        query_positions = torch.arange(first_position, first_position + q)
        for layer, queries in enumerate(queries_by_layer):
            blocks = torch.nonzero(self.live_blocks[layer]).flatten()
            keys, _, log_weights = self.block_tensors(layer, blocks, values=False)
            keys = keys.float()
            positions = blocks[:, None] * size + torch.arange(size)
            usable = (torch.arange(size) < self.num_tokens[layer, blocks, None]).flatten()
            allowed = usable[None, :] & (positions.flatten()[None, :] <= query_positions[:, None])  # [q, T]
            logits = torch.einsum("kgqd,tkd->kgqt", queries.reshape(kv_heads, heads // kv_heads, q, dim),
                                  keys.flatten(0, 1)) / dim**0.5 + log_weights.flatten(0, 1).T[:, None, None, :]
            weights = torch.softmax(logits.masked_fill(~allowed, -torch.inf), dim=-1).nan_to_num(0.0)
            share[layer, blocks] = weights.reshape(heads, q, len(blocks), size).sum(dim=-1).mean(dim=1).T
        return share

    @cached_property
    def neighbour_similarity(self) -> torch.Tensor:
        """``[L, N]`` cosine similarity of each block's mean key (KV heads concatenated) to the most similar
        other device block of the same layer; -1 when there is none."""
        if self.mean_key is None:
            return torch.full((self.num_layers, self.num_blocks), -1.0)
        keys = torch.nn.functional.normalize(self.mean_key.flatten(2), dim=-1)
        similarity = keys @ keys.transpose(1, 2)  # [L, N, N]
        candidate = (self.tier == Tier.DEVICE)[:, None, :] & ~torch.eye(self.num_blocks, dtype=torch.bool)[None]
        return similarity.masked_fill(~candidate, -1.0).amax(dim=-1)

    @cached_property
    def legal_ops(self) -> torch.Tensor:
        """``[L, N, 4]`` bool, indexed by ``Op``: what the cache would accept for each block now."""
        on_device = self.tier == Tier.DEVICE
        legal = torch.zeros(self.num_layers, self.num_blocks, len(Op), dtype=torch.bool)
        legal[..., Op.KEEP] = True
        legal[..., Op.EVICT] = on_device & ~self.pinned
        legal[..., Op.MERGE] = legal[..., Op.EVICT] & (self.device_blocks() > 1)[:, None]
        legal[..., Op.PREFETCH] = ((self.tier == Tier.HOST) | (self.tier == Tier.DISK)) & (self.device_free > 0)[:, None]
        return legal


@runtime_checkable
class Controller(Protocol):
    """A cache policy. ``decide`` is called at decision points and returns operations to apply in order;
    anything it leaves over budget is evicted afterwards by the cache's fallback rule (and counted)."""

    def decide(self, view: CacheView) -> list[Decision] | Placement: ...


def layer_budgets(controller, budget: list[int]) -> list[int]:
    """The per-layer budget a controller runs under: ``budget``, or the controller's own split of the same
    total (``controller.layer_budgets(budget)``, e.g. PyramidKV's pyramid); a split that exceeds the total
    or leaves a layer below 1 block is refused."""
    split = getattr(controller, "layer_budgets", None)
    if split is None:
        return list(budget)
    blocks = [int(b) for b in split(list(budget))]
    if len(blocks) != len(budget) or sum(blocks) > sum(budget) or min(blocks) < 1:
        raise ValueError(f"{type(controller).__name__}.layer_budgets: {blocks} is not a split of {list(budget)} "
                         f"(one entry per layer, each >= 1, total <= {sum(budget)})")
    return blocks


class EvictOldest:
    """Built-in rule: on each layer over budget, evict the oldest unpinned device blocks (FIFO)."""

    def decide(self, view: CacheView) -> list[Decision]:
        decisions = []
        over = view.device_blocks() - view.budget_blocks
        for layer in torch.nonzero(over > 0).flatten().tolist():
            evictable = (view.tier[layer] == Tier.DEVICE) & ~view.pinned[layer]
            oldest = torch.nonzero(evictable).flatten()[: int(over[layer])]
            decisions += [Decision(layer, block, Op.EVICT) for block in oldest.tolist()]
        return decisions


def apply_decisions(cache: PagedKVCache, decisions: list[Decision] | Placement) -> dict[str, int]:
    """Apply decisions as if one by one, in order; returns counts per operation name. A ``Placement`` (a
    decision as device masks, ``cache.placement``) is applied whole by ``apply_placement``.

    Merges are batched (``PagedKVCache.merge_blocks``: one gather / matmul / scatter for all layers instead
    of one call per block). Layers share no state, so only the order of each layer's own decisions matters:
    each layer's list is cut into runs of merges and runs of other operations; then, repeatedly, every
    layer's leading non-merge runs are applied (in order), and the merge runs now leading every layer are
    applied together as one batch. Within a run, a layer's merges are simultaneous: each block folds into
    the blocks of its layer that stay after the run, not into another block of the same run (one at a
    time, a later merge could have folded an earlier one's tokens a second time). Otherwise the result is
    that of the one-by-one order.

    Refusals keep the one-by-one semantics: the list is first checked against a simulation of the cache's
    rules; the decisions before the first refused one are applied (batched as above), then the rest one
    by one, so the refused decision raises ``CacheOperationError`` with everything before it applied and
    nothing after it.
    """
    from cache.placement import Placement, apply_placement  # below this module: it builds on Decision

    if isinstance(decisions, Placement):
        return apply_placement(cache, decisions)
    counts = {op.name.lower(): 0 for op in Op}
    refused = _first_refusal(cache, decisions)
    valid = decisions if refused is None else decisions[:refused]
    runs: dict[int, list[tuple[bool, list[Decision]]]] = {}
    for decision in valid:
        layer_runs = runs.setdefault(decision.layer, [])
        is_merge = Op(decision.op) == Op.MERGE
        if layer_runs and layer_runs[-1][0] == is_merge:
            layer_runs[-1][1].append(decision)
        else:
            layer_runs.append((is_merge, [decision]))
    queues = [deque(layer_runs) for layer_runs in runs.values()]
    while any(queues):
        for queue in queues:
            while queue and not queue[0][0]:
                for decision in queue.popleft()[1]:
                    _apply_one(cache, decision, counts)
        merges = [(d.layer, d.block) for queue in queues if queue for d in queue.popleft()[1]]
        if merges:
            cache.merge_blocks(merges)
            counts["merge"] += len(merges)
    for decision in decisions[len(valid):]:  # the refused decision raises here (with what is before it applied)
        _apply_one(cache, decision, counts)
    return counts


def _apply_one(cache: PagedKVCache, decision: Decision, counts: dict[str, int]) -> None:
    op = Op(decision.op)
    if op == Op.KEEP:
        cache.check_block(decision.layer, decision.block, "keep")
    elif op == Op.EVICT and decision.head >= 0:
        cache.drop_head(decision.layer, decision.block, decision.head)
    elif op == Op.EVICT:
        cache.evict(decision.layer, decision.block)
    elif op == Op.PREFETCH:
        cache.prefetch(decision.layer, decision.block)
    elif op == Op.MERGE:
        cache.merge(decision.layer, decision.block)
    counts[op.name.lower()] += 1


def _first_refusal(cache: PagedKVCache, decisions: list[Decision]) -> int | None:
    """Index of the first decision the cache would refuse if the list were applied one by one (simulated on
    the tiers and free-block counts; nothing changes), or None."""
    state: dict[int, dict] = {}
    for index, decision in enumerate(decisions):
        layer, block, op = decision.layer, decision.block, Op(decision.op)
        if not 0 <= layer < cache.num_layers or not 0 <= block < cache.num_logical_blocks(layer):
            return index
        if op == Op.KEEP:
            continue
        if layer not in state:
            pools = cache.pools[layer]
            state[layer] = {
                "tier": {}, "device": cache.tables.count_in(layer, Tier.DEVICE),
                "free": {tier: pools[tier].allocator.num_free if tier in pools else 0
                         for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK)},
            }
        layer_state = state[layer]
        tier = layer_state["tier"].get(block)
        if tier is None:
            tier = Tier(int(cache.tables.tier[layer, block]))
        free = layer_state["free"]
        if op == Op.EVICT and decision.head >= 0:  # one KV head's view: the block goes with its last head
            if tier != Tier.DEVICE or cache.is_pinned(layer, block) or not 0 <= decision.head < cache.num_kv_heads:
                return index
            heads = layer_state.setdefault("heads", {}).setdefault(
                block, set(torch.nonzero(cache.head_dropped[layer, :, block]).flatten().tolist()))
            if decision.head in heads:
                return index
            heads.add(decision.head)
            if len(heads) < cache.num_kv_heads:
                continue
        if op in (Op.EVICT, Op.MERGE):
            if tier != Tier.DEVICE or cache.is_pinned(layer, block):
                return index
            if op == Op.MERGE:
                if layer_state["device"] <= 1:
                    return index
                destination = Tier.DROPPED
            else:
                destination = next((t for t in (Tier.HOST, Tier.DISK) if free[t] > 0), Tier.DROPPED)
                if destination != Tier.DROPPED:
                    free[destination] -= 1
            free[Tier.DEVICE] += 1
            layer_state["device"] -= 1
            layer_state["tier"][block] = destination
        elif op == Op.PREFETCH:
            if tier not in (Tier.HOST, Tier.DISK) or free[Tier.DEVICE] == 0:
                return index
            free[Tier.DEVICE] -= 1
            free[tier] += 1
            layer_state["device"] += 1
            layer_state["tier"][block] = Tier.DEVICE
    return None
