"""SpindleKV (ACL 2025, arXiv 2507.06517; code github.com/tyxqc/SpindleKV, not read): attention-based
eviction in deep layers, similarity-based compression in shallow layers, so memory is spindle-shaped.

Source of the rules: the abstract (verified) and third-party paper notes (``research/baselines.md`` §2,
SECONDARY); the reference code was not available. Block mapping of the per-token rules:

- **Layer budgets: the total is spent.** ``layer_budgets`` (called once per run by the runner) keeps the
  runner's budget for the shallow layers and spreads the deep layers' total over them as PyramidKV's linear
  pyramid (``pyramid_split``: with ``C`` their mean budget, from ``2C − C/β`` in the first deep layer down to
  ``C/β`` in the last, the same total in whole blocks, none below the 2 pinned blocks). Every layer together
  holds what a uniform budget holds, so bytes read match the other baselines'. SpindleKV's own min/max
  retention (0.05 / 0.525) is configuration-specific and unverified, so PyramidKV's β is used.
- **Deep layers: eviction by normalised accumulated attention.** The paper scores key ``a`` by the attention
  it received divided by the number of queries that could see it (PyramidInfer's normalisation). Per block:
  the attention per query head summed over its tokens and over every counted query, divided by the mean
  number of counted queries that could see its tokens (``observed_mass_heads``; exact with the runner's 64-token
  chunks, which are counted whole), then the max over query heads (``aggregation``: the paper unfolds GQA
  and evicts per query head, keeping what any head keeps; ``"mean"`` also offered). The paper sums over an
  observation window ``l_w`` of recent queries; here every counted query is summed (the window's size is
  unverified). The observation window (the last ``window_tokens`` tokens, 64 as PyramidKV / KVCache-Factory's
  ``window_size``) is kept: its blocks score +inf and go last, oldest first, only if the budget leaves no choice.
- **Shallow layers: merging where the codebook would replace vectors.** The paper replaces a shallow-layer key
  (value) by a codeword when its cosine similarity to it exceeds θ_K = 0.98 (θ_V = 0.95), on **pre-RoPE** keys
  (re-rotated at use). Per token here: the cached post-RoPE keys are un-rotated at their positions, and a
  (token, KV head) is replaceable when its key reaches ``key_threshold`` and its value ``value_threshold``
  cosine with some token of another device block still kept. A block's redundancy is the share of its
  (token, KV head) pairs that are replaceable. A shallow layer over its budget frees blocks with the cache's
  ``merge`` (each token folds into its most key-similar resident token, D2O / ToMe style), greedily the
  unpinned, outside-the-window block of highest redundancy, as long as it is at least ``min_redundant_share``;
  a picked block stops counting as another's neighbour (two duplicates do not both go). Measured on
  SmolLM2-135M at 1k tokens (niah / passkey haystacks): 56–98% of shallow-layer (token, head) pairs pass
  both thresholds and most blocks pass the share, while post-RoPE block-mean keys never reach 0.98 (the old
  criterion, which never merged). Whatever merging cannot free is evicted by the deep-layer score.
- **Deviations of the merge from the codebook.** A codeword keeps each token's slot (index + magnitude) and
  re-rotates it at the token's own position; the cache's merge frees the block and folds each token into its
  nearest resident token by post-RoPE key similarity, so a merged token's position is that of the token it
  joins. Merging is budget-driven (only as many blocks as the layer is over budget), whereas the paper
  compresses every vector above the threshold.
- **Shallow/deep split.** Unverified in the paper ("predefined"). Default: the first quarter of the layers,
  rounded up (``ceil(0.25 L)``: 8 of 30 for SmolLM2-135M, 8 of 32 for Llama-3-8B, 1 of 2 for the tiny test
  model), are shallow.
- **Decision points.** The same rules at every decision: ``compress`` (one-shot: the paper's prefill
  compression), streaming ``prefill`` chunks, ``question`` and ``decode`` (the paper updates its codebook
  incrementally while decoding).
- **GQA.** Blocks are evicted per layer for all KV heads together (per-KV-head selection is out of scope);
  the paper unfolds GQA into per-query-head eviction (×g memory) and removes the duplicates with the codebook.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agents.baselines.base import (
    AGGREGATIONS,
    check_choice,
    device_tokens,
    evict,
    evictable,
    excess_blocks,
    lowest_scoring,
    observed_mass_heads,
    over_heads,
    pyramid_split,
    recent_blocks,
    rope_cos_sin,
    unrotate,
)
from cache.controller import CacheView, Decision, Op
from cache.tiers import Tier


def best_per_block(vectors: torch.Tensor, blocks: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[kv_heads, T, N]``: the highest cosine similarity between each token's vector (``vectors`` ``[T, kv_heads,
    dim]``) and the tokens of each block (``blocks`` ``[T]``); -1 for blocks without tokens."""
    unit = F.normalize(vectors.float(), dim=-1).transpose(0, 1)  # [kv_heads, T, dim]
    similarity = unit @ unit.transpose(1, 2)  # [kv_heads, T, T]
    index = blocks[None, None].expand_as(similarity)
    return torch.full((*similarity.shape[:2], num_blocks), -1.0).scatter_reduce_(2, index, similarity, "amax")


def redundant_blocks(view: CacheView, layer: int, count: int, key_threshold: float, value_threshold: float,
                     min_share: float, candidates: torch.Tensor) -> list[int]:
    """Up to ``count`` ``candidates`` of ``layer`` whose share of replaceable (token, KV head) pairs (pre-RoPE key
    cosine ≥ ``key_threshold`` and value cosine ≥ ``value_threshold`` with tokens of other device blocks still
    kept) is at least ``min_share``, most redundant first (ties: oldest); a picked block stops being a
    neighbour of later picks."""
    if count <= 0 or not bool(candidates.any()):
        return []
    tokens = device_tokens(view, layer)
    cos, sin = rope_cos_sin(view.cache.model_config, tokens.position)
    key_best = best_per_block(unrotate(tokens.keys, cos, sin), tokens.block, view.num_blocks)
    value_best = best_per_block(tokens.values, tokens.block, view.num_blocks)
    own = F.one_hot(tokens.block, view.num_blocks).bool()  # [T, N]
    kept = view.tier[layer] == Tier.DEVICE  # the blocks that stay, as neighbours of the merged ones
    counts = view.num_tokens[layer].clamp(min=1).float()
    picked = []
    while len(picked) < count:
        neighbours = (kept[None] & ~own)[None]  # [1, T, N]
        key_ok = key_best.masked_fill(~neighbours, -1.0).amax(dim=-1) >= key_threshold  # [kv_heads, T]
        value_ok = value_best.masked_fill(~neighbours, -1.0).amax(dim=-1) >= value_threshold
        replaceable = (key_ok & value_ok).float().mean(dim=0)  # [T]: share of KV heads
        share = torch.zeros(view.num_blocks).index_add_(0, tokens.block, replaceable) / counts
        share = share.masked_fill(~(candidates & kept), -1.0)
        block = int(share.argmax())  # the first maximum: oldest among ties
        if not share[block] >= min_share:
            break
        picked.append(block)
        kept[block] = False
    return picked


@dataclass
class SpindleKV:
    """SpindleKV: shallow layers merge redundant blocks, deep layers evict by attention (module docstring)."""
    shallow_fraction: float = 0.25  # first ceil(0.25 L) layers shallow (paper's split unverified)
    key_threshold: float = 0.98  # θ_K on pre-RoPE keys (secondary notes)
    value_threshold: float = 0.95  # θ_V on values (secondary notes)
    min_redundant_share: float = 0.5  # a block merges when at least this share of its (token, head) pairs pass
    beta: float = 20.0  # PyramidKV's β for the deep layers' pyramid (min = mean budget / β)
    window_tokens: int = 64  # observation window kept (PyramidKV / KVCache-Factory window_size)
    aggregation: str = "max"  # deep-layer score over query heads: "max" (GQA unfolded, as the paper) or "mean"

    def __post_init__(self):
        check_choice("SpindleKV", "aggregation", self.aggregation, AGGREGATIONS)
        if self.beta < 1:
            raise ValueError(f"SpindleKV: beta must be >= 1 (1 = uniform deep budgets), got {self.beta}")

    def shallow_layers(self, num_layers: int) -> int:
        return min(math.ceil(self.shallow_fraction * num_layers - 1e-9), num_layers)

    def layer_budgets(self, budget: list[int]) -> list[int]:
        """The runner's budget for the shallow layers; the deep layers' total as a pyramid over them."""
        shallow = self.shallow_layers(len(budget))
        return list(budget[:shallow]) + pyramid_split(list(budget[shallow:]), self.beta)

    def decide(self, view: CacheView) -> list[Decision]:
        window = recent_blocks(view, self.window_tokens) if self.window_tokens > 0 else torch.zeros(
            view.num_blocks, dtype=torch.bool)
        score = over_heads(observed_mass_heads(view), self.aggregation).masked_fill(window[None], float("inf"))
        shallow = self.shallow_layers(view.num_layers)
        decisions = []
        for layer in range(view.num_layers):
            excess = excess_blocks(view, layer)
            merged = []
            if layer < shallow:
                merged = redundant_blocks(view, layer, excess, self.key_threshold, self.value_threshold,
                                          self.min_redundant_share, evictable(view, layer) & ~window)
                decisions += evict(layer, merged, Op.MERGE)
            protect = torch.zeros(view.num_blocks, dtype=torch.bool)
            protect[merged] = True
            decisions += evict(layer, lowest_scoring(view, layer, score[layer], excess - len(merged), protect=protect))
        return decisions
