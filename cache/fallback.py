"""The budget fallback's eviction order, defined once: ``PagedKVCache.enforce_budget`` evicts in this order, and
the environments (live and replay) use it to pick their eviction candidates and to replay the fallback."""

from __future__ import annotations

import numpy as np

FALLBACK_RULES = ("lowest_mass", "heavy_recent", "oldest")
RECENT_PENALTY = 1e9  # added to a recent block's eviction key: it sorts after every older block


def eviction_key(acc_mass, budget_blocks, rule: str = "heavy_recent") -> np.ndarray:
    """``[L, n]`` float64 keys, lowest evicted first (a stable sort breaks ties to the oldest block), for the
    accumulated attention mass ``acc_mass`` ``[L, n]`` of ``n`` logical blocks and per-layer ``budget_blocks``:

    - ``lowest_mass``: the accumulated mass;
    - ``heavy_recent`` (H2O's split): the accumulated mass, with the newest ``budget // 2`` logical blocks of each
      layer (the protected recent window) after every older block;
    - ``oldest``: all equal (the stable sort keeps block order).
    """
    if rule not in FALLBACK_RULES:
        raise ValueError(f"unknown fallback rule {rule!r}: use one of {FALLBACK_RULES}")
    key = np.asarray(acc_mass, dtype=np.float64)
    if rule == "oldest":
        return np.zeros_like(key)
    if rule == "heavy_recent":
        n = key.shape[1]
        recent = np.arange(n)[None, :] >= n - (np.asarray(budget_blocks) // 2)[:, None]
        key = key + recent * RECENT_PENALTY
    return key
