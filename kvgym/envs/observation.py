"""Observation and action encoding shared by the live env, the replay env and the PPO controller.

A decision looks at ``K`` candidate blocks chosen by a cheap heuristic; each gets one op. The encoding is
a pure function of a ``CacheView`` (plus the run's progress, budget and bytes moved), so a trained policy
sees exactly the same numbers inside the env and when it is loaded into the cache as a controller.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gymnasium import spaces

from cache.controller import CacheView, Decision, Op
from cache.fallback import eviction_key
from cache.tiers import Tier

BLOCK_FEATURES = (
    "valid", "layer_depth", "age", "acc_mass", "recent_mass", "query_similarity", "neighbour_similarity",
    "tier_device", "tier_host", "tier_disk", "sentence_boundary", "pinned",
)
GLOBAL_FEATURES = ("progress", "budget", "bytes_moved")
NUM_OPS = len(Op)
DEVICE, HOST, DISK = int(Tier.DEVICE), int(Tier.HOST), int(Tier.DISK)
FALLBACK_RULE = "heavy_recent"  # the envs' budget fallback (PagedKVCache.enforce_budget); candidates follow it


def observation_space(num_layers: int, num_candidates: int) -> spaces.Dict:
    """Flat float32 boxes (SB3's ``MultiInputPolicy`` flattens them; no nested dicts)."""
    big = 1e4  # finite bounds: pressures, log masses and byte fractions stay far below this
    return spaces.Dict({
        "layer_pressure": spaces.Box(0.0, big, (num_layers,), np.float32),
        "tier_occupancy": spaces.Box(0.0, 1.0, (3,), np.float32),
        "blocks": spaces.Box(-1.0, big, (num_candidates * len(BLOCK_FEATURES),), np.float32),
        "globals": spaces.Box(0.0, big, (len(GLOBAL_FEATURES),), np.float32),
    })


def action_space(num_candidates: int) -> spaces.MultiDiscrete:
    """The slot env's action space: one operation per candidate slot."""
    return spaces.MultiDiscrete([NUM_OPS] * num_candidates)


@dataclass
class Encoded:
    """A view encoded for the slot env: the observation, the legal operations and the candidates behind them."""
    observation: dict[str, np.ndarray]
    mask: np.ndarray  # [K, 4] bool; keep always legal
    candidates: list[tuple[int, int]]  # (layer, block) per slot; padded slots are absent


def smallest_stable(key: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``key`` ``[R, n]``, the ``counts[r]`` smallest entries in (value, column) order: exactly the head
    of ``np.argsort(key[r], kind="stable")``, found with a partition instead of a full sort. Returns ``(rows,
    columns, rank)`` (row-major, ranks from 0)."""
    counts = np.minimum(counts, key.shape[1])
    if key.shape[0] == 1:  # one row: fewer calls
        values, count = key[0], int(counts[0])
        if count <= 0:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        pool = np.flatnonzero(values <= np.partition(values, count - 1)[count - 1]) if count < len(values) \
            else np.arange(len(values))
        columns = pool[np.argsort(values[pool], kind="stable")[:count]]
        return np.zeros(count, np.int64), columns, np.arange(count)
    top = int(counts.max()) if counts.size else 0
    if top == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    if top == 1:  # one per row (a decode step's new block): argmin is the first smallest
        rows = np.flatnonzero(counts > 0)
        return rows, key[rows].argmin(axis=1), np.zeros(len(rows), np.int64)
    head = np.sort(np.partition(key, top - 1, axis=1)[:, :top] if top < key.shape[1] else key, axis=1)
    bound = head[np.arange(key.shape[0]), np.maximum(counts, 1) - 1]
    selected = key <= bound[:, None]
    selected &= (counts > 0)[:, None]
    rows, columns = np.nonzero(selected)
    order = np.lexsort((columns, key[rows, columns], rows))
    rows, columns = rows[order], columns[order]
    rank = np.arange(len(rows)) - np.searchsorted(rows, rows, side="left")
    keep = rank < counts[rows]
    return rows[keep], columns[keep], rank[keep]


def choose_candidates(offloaded: np.ndarray, evictable: np.ndarray, query_similarity: np.ndarray,
                      eviction_order: np.ndarray, num_candidates: int) -> np.ndarray:
    """Flat indices into ``[L, N]`` of the candidate slots: up to ``K // 2`` offloaded blocks (host/disk)
    most similar to the current query (prefetch candidates), then evictable device blocks in the fallback's
    order (``cache.fallback.eviction_key``: the blocks the fallback would evict next come first), ties to the
    lower index (eviction/merge candidates). Shared by the live and the replay env, so both pick the same candidates
    from the same numbers."""
    picks = []
    count = min(np.count_nonzero(offloaded), num_candidates // 2)
    if count:
        similarity = torch.from_numpy(np.where(offloaded, query_similarity, -np.inf).ravel())
        picks.append(torch.topk(similarity, count).indices.numpy())
    count = min(np.count_nonzero(evictable), num_candidates - sum(len(p) for p in picks))
    if count:
        mass = np.where(evictable, eviction_order, np.inf).reshape(1, -1)
        picks.append(smallest_stable(mass, np.array([count]))[1])
    return np.concatenate(picks).astype(np.int64) if picks else np.zeros(0, np.int64)


def candidate_features(num_layers: int, seen: int, layers: np.ndarray, first_position: np.ndarray,
                       tier: np.ndarray, acc_mass: np.ndarray, recent_mass: np.ndarray,
                       query_similarity: np.ndarray, neighbour_similarity: np.ndarray,
                       sentence_boundary: np.ndarray, pinned: np.ndarray) -> np.ndarray:
    """``[c, len(BLOCK_FEATURES)]`` float32 features of ``c`` candidates, from per-candidate arrays."""
    seen = max(seen, 1)
    features = np.empty((len(layers), len(BLOCK_FEATURES)), np.float32)
    features[:, 0] = 1.0
    features[:, 1] = layers / max(num_layers - 1, 1)
    features[:, 2] = (seen - first_position) / seen
    features[:, 3] = np.log1p(acc_mass.astype(np.float64))
    features[:, 4] = np.log1p(recent_mass.astype(np.float64))
    features[:, 5] = query_similarity
    features[:, 6] = neighbour_similarity
    for column, tier_value in ((7, DEVICE), (8, HOST), (9, DISK)):
        features[:, column] = tier == tier_value
    features[:, 10] = sentence_boundary
    features[:, 11] = pinned
    return features


def encode(view: CacheView, num_candidates: int, progress: float, budget_fraction: float,
           bytes_moved_fraction: float) -> Encoded:
    """The observation dict, the [K, 4] action mask and the slot → (layer, block) map for ``view``."""
    tier = view.tier.numpy()
    pinned = view.pinned.numpy()
    offloaded = (tier == Tier.HOST) | (tier == Tier.DISK)
    evictable = (tier == Tier.DEVICE) & ~pinned
    query_similarity = view.query_similarity.numpy()
    order = eviction_key(view.acc_mass.numpy(), view.budget_blocks.numpy(), FALLBACK_RULE)
    flat = choose_candidates(offloaded, evictable, query_similarity, order, num_candidates)
    layers, blocks = np.divmod(flat, view.num_blocks)
    c = len(flat)
    blocks_features = np.zeros((num_candidates, len(BLOCK_FEATURES)), np.float32)
    mask = np.zeros((num_candidates, NUM_OPS), bool)
    mask[:, Op.KEEP] = True
    if c:
        blocks_features[:c] = candidate_features(
            view.num_layers, view.seen, layers, view.first_position.numpy()[blocks], tier[layers, blocks],
            view.acc_mass.numpy()[layers, blocks], view.recent_mass.numpy()[layers, blocks],
            query_similarity[layers, blocks], view.neighbour_similarity.numpy()[layers, blocks],
            view.sentence_boundary.numpy()[blocks], pinned[layers, blocks])
        mask[:c] = view.legal_ops.numpy()[layers, blocks]
    observation = {
        "layer_pressure": view.pressure.numpy().astype(np.float32),
        "tier_occupancy": view.tier_occupancy.numpy().astype(np.float32),
        "blocks": blocks_features.reshape(-1),
        "globals": np.array([progress, budget_fraction, bytes_moved_fraction], np.float32),
    }
    candidates = list(zip(layers.tolist(), blocks.tolist(), strict=True))
    return Encoded(observation=observation, mask=mask, candidates=candidates)


def decode_action(action: np.ndarray, encoded: Encoded) -> tuple[list[Decision], int]:
    """Decisions for the chosen ops, and how many chosen ops were masked (illegal): those act as keep, so an
    unmasked agent (or an env checker) cannot break the cache; a masked agent never picks them."""
    decisions, illegal = [], 0
    for slot, op in enumerate(np.asarray(action).tolist()):
        if op == Op.KEEP:
            continue
        if not encoded.mask[slot, op]:
            illegal += 1
            continue
        layer, block = encoded.candidates[slot]
        decisions.append(Decision(layer, block, Op(op)))
    # evictions and merges first, so prefetches find the room they free
    return sorted(decisions, key=lambda d: d.op == Op.PREFETCH), illegal
