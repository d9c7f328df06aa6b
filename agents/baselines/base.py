"""Helpers shared by the baselines: picking blocks to evict or fetch by a score, within each layer's budget (or
the global one);
aggregating per-head scores; layer budget schedules; token-level keys and values of the device blocks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

from cache.controller import CacheView, Decision, Op
from cache.tiers import Tier


def evictable(view: CacheView, layer: int) -> torch.Tensor:
    """Bool ``[N]``: device blocks of ``layer`` that may be evicted (not pinned)."""
    return (view.tier[layer] == Tier.DEVICE) & ~view.pinned[layer]


def excess_blocks(view: CacheView, layer: int, budget: int | None = None) -> int:
    """How many device blocks ``layer`` holds above ``budget`` (default: the view's budget for the layer)."""
    budget = int(view.budget_blocks[layer]) if budget is None else budget
    return max(int((view.tier[layer] == Tier.DEVICE).sum()) - budget, 0)


def lowest_scoring(view: CacheView, layer: int, scores: torch.Tensor, count: int,
                   protect: torch.Tensor | None = None) -> list[int]:
    """The ``count`` evictable blocks of ``layer`` with the lowest ``scores`` (ties: oldest first), skipping
    blocks where ``protect`` is True."""
    if count <= 0:
        return []
    candidates = evictable(view, layer)
    if protect is not None:
        candidates &= ~protect
    blocks = torch.nonzero(candidates).flatten()
    order = torch.sort(scores[blocks].float(), stable=True).indices
    return blocks[order][:count].tolist()


def evict(layer: int, blocks: list[int], op: Op = Op.EVICT) -> list[Decision]:
    """One decision per block of ``layer``: ``op`` (evict by default) for each of ``blocks``."""
    return [Decision(layer, block, op) for block in blocks]


def recent_blocks(view: CacheView, recent_tokens: int) -> torch.Tensor:
    """Bool ``[N]``: blocks that hold any of the last ``recent_tokens`` positions."""
    last_position = view.first_position + view.num_tokens.max(dim=0).values - 1
    return last_position >= view.seen - recent_tokens


def make_resident(view: CacheView, layer: int, priority: list[int] | torch.Tensor) -> list[Decision]:
    """Decisions that make ``layer``'s device set its pinned blocks plus the first blocks of ``priority`` that fit
    in the layer's budget (dropped blocks and repeats skipped): evict every other device block, prefetch the
    chosen host/disk ones.

    Order: the prefetches that fit in the device pool's free slots first (each frees a host slot, so an eviction
    that follows lands on the host instead of being dropped when the host is full), then the evictions, then the
    prefetches that need the room those free.
    """
    tier = view.tier[layer].tolist()
    chosen = dict.fromkeys(torch.nonzero(view.pinned[layer]).flatten().tolist())  # an ordered set
    budget = int(view.budget_blocks[layer])
    for block in priority.tolist() if isinstance(priority, torch.Tensor) else priority:
        if len(chosen) >= budget:
            break
        if tier[block] != Tier.DROPPED:
            chosen.setdefault(block)
    evictions = [block for block, where in enumerate(tier) if where == Tier.DEVICE and block not in chosen]
    prefetches = [block for block in chosen if tier[block] in (Tier.HOST, Tier.DISK)]
    free = int(view.device_free[layer])
    return (evict(layer, prefetches[:free], Op.PREFETCH) + evict(layer, evictions)
            + evict(layer, prefetches[free:], Op.PREFETCH))


# ------------------------------------------------------------------------------------------ scores per layer
AGGREGATIONS = ("mean", "max")  # how per-query-head scores become one score per block (one table per layer)


def check_choice(owner: str, name: str, value, choices) -> None:
    """Refuse ``value`` of ``owner``'s parameter ``name`` unless it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def over_heads(per_head: torch.Tensor, aggregation: str) -> torch.Tensor:
    """``[L, H, N]`` → ``[L, N]``: the mean or the max over query heads (the max keeps a block that a single
    retrieval head needs; a mean drowns it among the heads that ignore it)."""
    return per_head.mean(dim=1) if aggregation == "mean" else per_head.amax(dim=1)


def observed_mass_heads(view: CacheView) -> torch.Tensor:
    """``[L, H, N]`` accumulated attention per query head divided by the mean number of counted queries that
    could see each of the block's tokens (``CacheView.observed_mass`` per head: kvpress's ObservedAttention,
    ``Σ_i A_ij / (n − j)``)."""
    if view.acc_mass_heads is None:
        return torch.zeros(view.num_layers, 1, view.num_blocks)
    observers = view.cache.stats.observers[:, : view.num_blocks] / view.num_tokens.clamp(min=1)
    return view.acc_mass_heads / observers.clamp(min=1.0)[:, None, :]


def evict_lowest(view: CacheView, scores: torch.Tensor, protect: torch.Tensor | None = None) -> list[Decision]:
    """On every layer over budget, evict the evictable device blocks with the lowest ``scores`` ``[L, N]`` (ties:
    oldest first) until it fits, never a block where ``protect`` (``[N]`` or ``[L, N]``) is True. Under a global
    budget (``view.total_budget``, kvpress's ``layerwise=False``) the lowest scores over all layers go, until the
    device total fits: how many blocks each layer keeps follows from the scores."""
    if view.total_budget is not None:
        return _evict_lowest_overall(view, scores, protect)
    decisions = []
    for layer in range(view.num_layers):
        guard = protect if protect is None or protect.dim() == 1 else protect[layer]
        decisions += evict(layer, lowest_scoring(view, layer, scores[layer], excess_blocks(view, layer), guard))
    return decisions


def _evict_lowest_overall(view: CacheView, scores: torch.Tensor, protect: torch.Tensor | None) -> list[Decision]:
    excess = int(view.device_blocks().sum()) - int(view.total_budget)
    if excess <= 0:
        return []
    candidates = (view.tier == Tier.DEVICE) & ~view.pinned
    if protect is not None:
        candidates &= ~protect.expand_as(candidates)
    layers, blocks = torch.nonzero(candidates, as_tuple=True)  # layer-major: ties go to the earlier layer, oldest
    lowest = torch.sort(scores[layers, blocks].float(), stable=True).indices[:excess]
    return [Decision(int(layers[i]), int(blocks[i]), Op.EVICT) for i in lowest.tolist()]


def prompt_first_priority(scores: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[L, N]`` eviction order of a one-shot method during decoding: the ``P`` blocks it scored (``scores``
    ``[L, P]``) go first, lowest score first; the blocks written since go after all of them, oldest first (the
    cache grows from the compressed prompt; when a fixed budget forces more evictions, the prompt pays first)."""
    scored = scores.shape[1]
    later = torch.arange(num_blocks - scored, dtype=scores.dtype)
    top = scores.amax(dim=1, keepdim=True) if scored else torch.zeros(scores.shape[0], 1)
    return torch.cat([scores, top + 1 + later.expand(scores.shape[0], -1)], dim=1)


def pyramid_split(budget: list[int], beta: float, minimum: int = 2) -> list[int]:
    """PyramidKV's linear schedule (arXiv 2406.02069 §3.6; KVCache-Factory ``pyramidkv_utils.py``; kvpress
    ``PyramidKVPress.get_layer_budget``) over consecutive layers, spending the same total: with ``C`` the mean
    of ``budget``, ``low = C / β``, ``high = 2C − low``, layer ``i`` of ``m`` gets ``high − i (high − low) / (m − 1)``
    (most in the first layer), in whole blocks summing to ``sum(budget)`` exactly (largest remainders round
    up), none below ``minimum`` (the cache's pinned sink and newest blocks; the top layers give the difference).
    ``β = 1`` is the uniform split."""
    total, layers = sum(budget), len(budget)
    if layers <= 1 or total < minimum * layers:
        return list(budget)
    mean = total / layers
    low, high = mean / beta, 2 * mean - mean / beta
    shares = [high - index * (high - low) / (layers - 1) for index in range(layers)]
    blocks = [max(math.floor(share + 1e-9), minimum) for share in shares]
    by_remainder = sorted(range(layers), key=lambda index: blocks[index] - shares[index])
    for step in range(max(total - sum(blocks), 0)):
        blocks[by_remainder[step % layers]] += 1
    while sum(blocks) > total:
        blocks[max(range(layers), key=lambda index: blocks[index])] -= 1
    return blocks


# ----------------------------------------------------------------------------------- token-level statistics
@dataclass
class Tokens:
    """The tokens of one layer's device blocks, in position order: ``block`` and ``position`` ``[T]``, ``keys``
    (post-RoPE, as cached) and ``values`` ``[T, kv_heads, head_dim]`` (float32, on the CPU)."""

    block: torch.Tensor
    position: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def device_tokens(view: CacheView, layer: int) -> Tokens:
    """Every token of ``layer``'s device blocks, read from the device pool."""
    blocks = torch.nonzero(view.tier[layer] == Tier.DEVICE).flatten()
    bs = view.cache.block_size
    valid = torch.arange(bs)[None] < view.num_tokens[layer, blocks][:, None]  # [B, bs]
    pool = view.cache.device_pool(layer)
    physical = view.cache.tables.physical[layer, blocks].to(pool.keys.device)
    keys = pool.keys[physical].float().cpu()[valid]
    values = pool.values[physical].float().cpu()[valid]
    position = (view.first_position[blocks][:, None] + torch.arange(bs)[None])[valid]
    return Tokens(blocks[:, None].expand_as(valid)[valid], position, keys, values)


def per_block(token_scores: torch.Tensor, tokens: Tokens, num_blocks: int, reduce: str) -> torch.Tensor:
    """``[T]`` token scores → ``[N]`` block scores by ``"sum"`` (masses) or ``"max"`` (a page is worth its best
    token); blocks without device tokens get 0 (they are never eviction candidates)."""
    check_choice("per_block", "reduce", reduce, ("sum", "max"))
    if reduce == "sum":
        return torch.zeros(num_blocks).index_add_(0, tokens.block, token_scores.float())
    out = torch.full((num_blocks,), -float("inf")).scatter_reduce_(0, tokens.block, token_scores.float(), "amax")
    return out.masked_fill(torch.isinf(out), 0.0)


def token_scores_per_block(view: CacheView, score: Callable[[Tokens], torch.Tensor], reduce: str) -> torch.Tensor:
    """``[L, N]``: ``score(tokens)`` (``[T]``) of every layer's device tokens, reduced per block."""
    rows = []
    for layer in range(view.num_layers):
        tokens = device_tokens(view, layer)
        rows.append(per_block(score(tokens), tokens, view.num_blocks, reduce))
    return torch.stack(rows)


def rope_cos_sin(model_config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary ``cos``, ``sin`` ``[P, head_dim]`` at ``positions`` (its own RoPE type and scaling)."""
    rotary = LlamaRotaryEmbedding(config=model_config)
    cos, sin = rotary(torch.zeros(1), positions.reshape(1, -1).long())
    return cos[0], sin[0]


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: ``x`` ``[P, heads, head_dim]`` rotated at the positions of ``cos``/``sin`` ``[P, head_dim]`` →
    the pre-RoPE vectors (exact for any attention scaling: ``cos² + sin²`` is divided out)."""
    cos, sin = cos[:, None], sin[:, None]
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)
