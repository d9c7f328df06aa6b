"""SpindleKV (ACL 2025, arXiv 2507.06517; code github.com/tyxqc/SpindleKV, not read): attention-based
eviction in deep layers, similarity-based compression in shallow layers, so memory is spindle-shaped.

Source of the rules: the abstract (verified) and third-party paper notes (``research/baselines.md`` §2,
SECONDARY); the reference code was not available. Block mapping of the two per-token rules:

- **Deep layers: eviction by normalised accumulated attention.** The paper scores key ``a`` by the attention
  it received divided by the number of queries that could see it, ``Σ_b A[b, a] / (l − a)`` (PyramidInfer's
  normalisation). Per block we use the cache's ``acc_mass`` (attention mass summed over every recorded query
  and over the block's tokens) divided by ``seen − first_position``, the number of queries that could see the
  block's first token. That is exact in the runner's default setting (prefill chunks of 64 ≤ the cache's
  ``stats_window`` 64, so every query is recorded) up to the block's later tokens being visible to a few
  fewer queries; with larger prefill chunks only each chunk's last ``stats_window`` queries are recorded, so
  blocks from early chunks are under-scored. Blocks off the device receive no mass while away. The
  observation window (the last ``window_tokens`` tokens, here 64 as PyramidKV / KVCache-Factory's
  ``window_size``; SpindleKV's ``l_w`` is unverified) is kept: its blocks score +inf and go last, oldest
  first, only if the budget leaves no other choice.
- **Deep layers: pyramid budgets.** PyramidKV's linear schedule (§3.6) over the deep layers ``λ = 0..m−1``:
  with ``C`` the mean of their view budgets, ``low = C / β``, ``high = 2C − low`` and
  ``pyramid(λ) = high − λ (high − low) / (m − 1)`` (mean ``C``), most in the first deep layer. Every layer
  must still meet its own ``view.budget_blocks``, so each deep layer gets ``min(view budget, ⌊pyramid(λ)⌋)``
  (never fewer than its pinned device blocks): the pyramid only takes budget away, from the deepest layers,
  and the clipped top is not redistributed (there is no layer allowed to take it). With a uniform budget
  and β = 20 the first half of the deep layers keep the full budget and the second half fall linearly to
  ``C / 20``, about 3/4 of ``C`` on average. One deep layer gets its view budget. SpindleKV's own min/max
  retention (0.05 / 0.525) is configuration-specific and unverified, so PyramidKV's β is used.
- **Shallow layers: merging instead of a codebook.** The paper replaces each shallow-layer key (value) by a
  codeword when its cosine similarity to the codeword exceeds θ_K = 0.98 (θ_V = 0.95), greedily from the
  most connected vector. Here a shallow layer over its budget frees blocks with the cache's ``merge``
  (each token folds into its most key-similar resident token, D2O / ToMe style), choosing greedily the
  unpinned, outside-the-window block whose mean key is most cosine-similar to another device block's, as
  long as that similarity is ≥ ``key_threshold``. The first pick is ``view.neighbour_similarity``'s best;
  the similarities are recomputed from ``view.mean_key`` with the same formula so that a picked block stops
  counting as a neighbour of later picks (two duplicates do not both go). Approximations: similarity is of
  block-mean post-RoPE keys (KV heads concatenated), not per-token pre-RoPE keys, so a block passing the
  test may hold tokens below θ_K (the merge folds them anyway: the runner's merge takes no threshold,
  and ``merge(min_similarity)`` would refuse a block where no token reaches it); values are not checked
  (the merge has no θ_V); and merging is budget-driven (only as many blocks as the layer is over budget),
  whereas the paper compresses every vector above the threshold. Whatever merging cannot free is evicted by the deep-layer
  score. Merges come first in the decision list, then evictions. Measured on SmolLM2-135M (1,024 tokens of
  prose): no block-mean pair reaches 0.98 in any layer while most reach 0.9 (block means share a dominant
  direction), so with the paper's θ_K the shallow layers in practice evict; lower ``key_threshold`` to merge.
- **Shallow/deep split.** Unverified in the paper ("predefined"). Default: the first quarter of the layers,
  rounded up (``ceil(0.25 L)``: 8 of 30 for SmolLM2-135M, 8 of 32 for Llama-3-8B, 1 of 2 for the tiny test
  model), are shallow.
- **GQA.** The cache's attention mass is averaged over all query heads of a layer (GQA groups included) and
  blocks are evicted per layer for all KV heads together; the paper instead unfolds GQA into per-query-head
  eviction (×g memory) and removes the duplicates with the codebook. Block tables are per layer, so a
  per-head rule is not expressible here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agents.baselines.base import evictable, excess_blocks, lowest_scoring, recent_blocks
from cache.controller import CacheView, Decision, Op
from cache.tiers import Tier


def normalised_mass(view: CacheView) -> torch.Tensor:
    """``[L, N]`` accumulated attention mass per query that could see the block (``seen − first_position``)."""
    queries = (view.seen - view.first_position).clamp(min=1).float()
    return view.acc_mass / queries[None]


def pyramid_budgets(budgets: list[int], beta: float, floors: list[int] | None = None) -> list[int]:
    """PyramidKV's linear schedule over consecutive layers with view ``budgets`` (mean ``C``: from
    ``2C − C/β`` down to ``C/β``), floored to whole blocks, clipped to each layer's budget and raised to
    ``floors`` (each layer's pinned blocks)."""
    m = len(budgets)
    floors = floors if floors is not None else [0] * m
    if m <= 1:
        return [max(b, f) for b, f in zip(budgets, floors, strict=True)]
    mean = sum(budgets) / m
    low = mean / beta
    high = 2 * mean - low
    out = []
    for index, (budget, floor) in enumerate(zip(budgets, floors, strict=True)):
        share = high - index * (high - low) / (m - 1)
        out.append(max(min(budget, math.floor(share + 1e-9)), floor))
    return out


def similar_blocks(view: CacheView, layer: int, count: int, threshold: float,
                   candidates: torch.Tensor) -> list[int]:
    """Up to ``count`` ``candidates`` of ``layer`` whose mean key has cosine ≥ ``threshold`` with another device
    block's, most similar first; a picked block stops being a neighbour of later picks (ties: oldest)."""
    if count <= 0 or view.mean_key is None:
        return []
    keys = torch.nn.functional.normalize(view.mean_key[layer].flatten(1), dim=-1)  # [N, kv_heads * head_dim]
    similarity = keys @ keys.T
    similarity.fill_diagonal_(-float("inf"))
    alive = (view.tier[layer] == Tier.DEVICE).clone()
    picked = []
    while len(picked) < count:
        best = similarity.masked_fill(~alive[None], -float("inf")).amax(dim=1)
        best = best.masked_fill(~(candidates & alive), -float("inf"))
        block = int(best.argmax())  # the first maximum: oldest among ties
        if not best[block] >= threshold:
            break
        picked.append(block)
        alive[block] = False
    return picked


@dataclass
class SpindleKV:
    shallow_fraction: float = 0.25  # first ceil(0.25 L) layers shallow (paper's split unverified)
    key_threshold: float = 0.98  # θ_K, secondary notes; θ_V = 0.95 is not checked by the cache's merge
    beta: float = 20.0  # PyramidKV's β (min budget = mean / β)
    window_tokens: int = 64  # observation window kept (PyramidKV / KVCache-Factory window_size)

    def shallow_layers(self, num_layers: int) -> int:
        return min(math.ceil(self.shallow_fraction * num_layers - 1e-9), num_layers)

    def layer_budgets(self, view: CacheView) -> list[int]:
        """Each layer's device budget: the view's for shallow layers, the clipped pyramid for deep layers."""
        budgets = view.budget_blocks.tolist()
        shallow = self.shallow_layers(view.num_layers)
        pinned = (view.pinned & (view.tier == Tier.DEVICE)).sum(dim=1).tolist()
        return budgets[:shallow] + pyramid_budgets(budgets[shallow:], self.beta, pinned[shallow:])

    def decide(self, view: CacheView) -> list[Decision]:
        window = recent_blocks(view, self.window_tokens) if self.window_tokens > 0 else torch.zeros(
            view.num_blocks, dtype=torch.bool)
        score = normalised_mass(view).masked_fill(window[None], float("inf"))
        shallow = self.shallow_layers(view.num_layers)
        decisions = []
        for layer, budget in enumerate(self.layer_budgets(view)):
            excess = excess_blocks(view, layer, budget)
            merged = []
            if layer < shallow:
                merged = similar_blocks(view, layer, excess, self.key_threshold, evictable(view, layer) & ~window)
                decisions += [Decision(layer, block, Op.MERGE) for block in merged]
            protect = torch.zeros(view.num_blocks, dtype=torch.bool)
            protect[merged] = True
            victims = lowest_scoring(view, layer, score[layer], excess - len(merged), protect=protect)
            decisions += [Decision(layer, block, Op.EVICT) for block in victims]
        return decisions
