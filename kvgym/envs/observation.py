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
from cache.tiers import Tier

BLOCK_FEATURES = (
    "valid", "layer_depth", "age", "acc_mass", "recent_mass", "query_similarity", "neighbour_similarity",
    "tier_device", "tier_host", "tier_disk", "sentence_boundary", "pinned",
)
GLOBAL_FEATURES = ("progress", "budget", "bytes_moved")
NUM_OPS = len(Op)


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
    return spaces.MultiDiscrete([NUM_OPS] * num_candidates)


@dataclass
class Encoded:
    observation: dict[str, np.ndarray]
    mask: np.ndarray  # [K, 4] bool; keep always legal
    candidates: list[tuple[int, int]]  # (layer, block) per slot; padded slots are absent


def select_candidates(view: CacheView, num_candidates: int) -> list[tuple[int, int]]:
    """Up to ``K // 2`` offloaded blocks (host/disk) most similar to the current query (prefetch candidates),
    then device blocks that may be evicted, lowest accumulated attention first (eviction/merge candidates)."""
    offloaded = (view.tier == Tier.HOST) | (view.tier == Tier.DISK)
    evictable = (view.tier == Tier.DEVICE) & ~view.pinned
    picks: list[tuple[int, int]] = []
    if offloaded.any():
        similarity = view.query_similarity.masked_fill(~offloaded, -np.inf).flatten()
        count = min(int(offloaded.sum()), num_candidates // 2)
        for flat in torch.topk(similarity, count).indices.tolist():
            picks.append(divmod(flat, view.num_blocks))
    if evictable.any():
        mass = view.acc_mass.masked_fill(~evictable, np.inf).flatten()
        count = min(int(evictable.sum()), num_candidates - len(picks))
        order = torch.sort(mass, stable=True).indices[:count]
        picks += [divmod(flat, view.num_blocks) for flat in order.tolist()]
    return picks


def encode(view: CacheView, num_candidates: int, progress: float, budget_fraction: float,
           bytes_moved_fraction: float) -> Encoded:
    """The observation dict, the [K, 4] action mask and the slot → (layer, block) map for ``view``."""
    candidates = select_candidates(view, num_candidates)
    blocks = np.zeros((num_candidates, len(BLOCK_FEATURES)), np.float32)
    mask = np.zeros((num_candidates, NUM_OPS), bool)
    mask[:, Op.KEEP] = True
    legal = view.legal_ops
    seen = max(view.seen, 1)
    depth_scale = max(view.num_layers - 1, 1)
    for slot, (layer, block) in enumerate(candidates):
        tier = int(view.tier[layer, block])
        blocks[slot] = (
            1.0, layer / depth_scale, (seen - int(view.first_position[block])) / seen,
            np.log1p(float(view.acc_mass[layer, block])), np.log1p(float(view.recent_mass[layer, block])),
            float(view.query_similarity[layer, block]), float(view.neighbour_similarity[layer, block]),
            tier == Tier.DEVICE, tier == Tier.HOST, tier == Tier.DISK,
            float(view.sentence_boundary[block]), float(view.pinned[layer, block]),
        )
        mask[slot] = legal[layer, block].numpy()
    observation = {
        "layer_pressure": view.pressure.numpy().astype(np.float32),
        "tier_occupancy": view.tier_occupancy.numpy().astype(np.float32),
        "blocks": blocks.reshape(-1),
        "globals": np.array([progress, budget_fraction, bytes_moved_fraction], np.float32),
    }
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
