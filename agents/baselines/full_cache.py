"""FullCache: never evicts. The upper bound every policy is compared with."""

from __future__ import annotations

from dataclasses import dataclass

from cache.controller import CacheView, Decision


@dataclass
class FullCache:
    """Keeps every block on the device. ``full_cache = True`` tells the runner to ignore the budget."""

    full_cache = True

    def decide(self, view: CacheView) -> list[Decision]:
        return []
