"""Scripted policies on the env's action space, and every controller projected onto it.

A policy maps ``(view, encoded, rng)`` (the ``CacheView`` and the env's encoded observation, from
``policy_inputs(env)``) to an action. They run the same on the live and the replay env (the replay-vs-live
comparison in ``eval/replay_compare.py``), serve as teachers for behaviour cloning (``agents/ppo/imitation.py``)
and as replay baselines (``kvgym traces compare``).

``make_policy(spec)`` reads the one spec grammar of ``agents/registry.py`` (``name`` or
``name:value,key=value``):

- ``fallback``: always keep (the budget is met by the fallback rule);
- ``evict:ORDER[,extra=N]`` / ``merge:ORDER[,extra=N]``: ``Scripted``;
- ``prefetch[:THRESHOLD]``: ``Prefetch``;
- ``random[:PROBABILITY]``: ``Random``;
- ``ppo:PATH``: a trained policy acting on the encoded observation;
- any other registered controller spec (``lru``, ``h2o:recent_ratio=0.25``, ...), projected with
  ``controller_policy``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from agents.registry import CONTROLLERS, LEARNED, make_controller, parse_spec
from cache.controller import CacheView, Op
from kvgym.envs.observation import Encoded

Policy = Callable[[CacheView, Encoded, np.random.Generator], np.ndarray]

# feature column of the encoded observation (observation.BLOCK_FEATURES), and whether high values go first
ORDERS = {"mass": (3, False), "recent": (4, False), "oldest": (2, True), "newest": (2, False),
          "query": (5, False), "neighbour": (6, True)}

SCRIPTED: dict[str, str] = {
    "fallback": "agents.scripted:Fallback",
    "evict": "agents.scripted:Evict",
    "merge": "agents.scripted:Merge",
    "prefetch": "agents.scripted:Prefetch",
    "random": "agents.scripted:Random",
}


def _features(encoded: Encoded) -> np.ndarray:
    return encoded.observation["blocks"].reshape(len(encoded.mask), -1)


def _assign_by_layer_quota(action: np.ndarray, encoded: Encoded, op: int, score: np.ndarray,
                           left: np.ndarray) -> None:
    """Give ``op`` to the legal slots in ascending ``score`` order while their layer's quota ``left`` lasts."""
    legal = np.flatnonzero(encoded.mask[:, op])
    for slot in legal[np.argsort(score[legal], kind="stable")].tolist():
        layer = encoded.candidates[slot][0]
        if left[layer] > 0:
            action[slot] = op
            left[layer] -= 1


@dataclass
class Fallback:
    """Always keep: the budget fallback makes every eviction."""

    def __call__(self, view: CacheView, encoded: Encoded, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(len(encoded.mask), np.int64)


@dataclass
class Scripted:
    """Per layer, ``op`` (evict or merge) on the layer's over-budget count (+ ``extra``) of its candidate slots,
    ranked by a feature of the observation: ``mass`` (lowest accumulated attention first), ``recent``, ``oldest``,
    ``newest``, ``query`` (least similar to the query), ``neighbour`` (most similar to another block)."""

    order: str = "mass"
    extra: int = 0
    op: ClassVar[Op] = Op.EVICT
    positional_parameter: ClassVar[str] = "order"

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"{self.op.name.lower()}: unknown order {self.order!r}; choose from {sorted(ORDERS)}")

    def __call__(self, view: CacheView, encoded: Encoded, rng: np.random.Generator) -> np.ndarray:
        column, descending = ORDERS[self.order]
        action = np.zeros(len(encoded.mask), np.int64)
        left = (view.device_blocks() - view.budget_blocks).numpy() + self.extra
        score = _features(encoded)[:, column] * (-1.0 if descending else 1.0)
        _assign_by_layer_quota(action, encoded, int(self.op), score, left)
        return action


@dataclass
class Evict(Scripted):
    """The scripted policy that evicts the blocks its rule picks."""
    op: ClassVar[Op] = Op.EVICT


@dataclass
class Merge(Scripted):
    """The scripted policy that merges the blocks its rule picks into their neighbours."""
    op: ClassVar[Op] = Op.MERGE


@dataclass
class Prefetch:
    """Prefetch the offloaded candidates more similar to the query than ``threshold``, then evict the
    lowest-mass candidates of each layer to make room (and meet the budget)."""

    threshold: float = 0.0
    positional_parameter: ClassVar[str] = "threshold"

    def __call__(self, view: CacheView, encoded: Encoded, rng: np.random.Generator) -> np.ndarray:
        action = np.zeros(len(encoded.mask), np.int64)
        features = _features(encoded)
        left = (view.device_blocks() - view.budget_blocks).numpy()
        for slot in np.flatnonzero(encoded.mask[:, Op.PREFETCH] & (features[:, 5] > self.threshold)).tolist():
            action[slot] = Op.PREFETCH
            left[encoded.candidates[slot][0]] += 1
        _assign_by_layer_quota(action, encoded, int(Op.EVICT), features[:, 3], left)
        return action


@dataclass
class Random:
    """Each slot, with ``probability``, takes a uniformly random legal non-keep op."""

    probability: float = 0.2
    positional_parameter: ClassVar[str] = "probability"

    def __call__(self, view: CacheView, encoded: Encoded, rng: np.random.Generator) -> np.ndarray:
        action = np.zeros(len(encoded.mask), np.int64)
        for slot in np.flatnonzero(rng.random(len(encoded.mask)) < self.probability).tolist():
            ops = np.flatnonzero(encoded.mask[slot, 1:]) + 1
            if len(ops):
                action[slot] = int(rng.choice(ops))
        return action


def controller_policy(controller) -> Policy:
    """A cache controller projected onto the action space: its decisions on candidate blocks become the slots'
    ops (legal ones only); decisions on other blocks are dropped (the fallback rule covers the budget)."""

    def policy(view: CacheView, encoded: Encoded, rng: np.random.Generator) -> np.ndarray:
        action = np.zeros(len(encoded.mask), np.int64)
        slots = {candidate: slot for slot, candidate in enumerate(encoded.candidates)}
        for decision in controller.decide(view):
            slot = slots.get((decision.layer, decision.block))
            if slot is not None and encoded.mask[slot, int(decision.op)]:
                action[slot] = int(decision.op)
        return action

    return policy


def make_policy(spec: str) -> Policy:
    """A fresh policy from a spec (see the module docstring)."""
    name = parse_spec(spec)[0]
    if name in SCRIPTED:
        return make_controller(spec, SCRIPTED)
    if name not in CONTROLLERS:
        raise ValueError(f"unknown policy {name!r}: choose a scripted policy ({', '.join(sorted(SCRIPTED))}) "
                         f"or a controller ({', '.join(sorted(CONTROLLERS))})")
    controller = make_controller(spec)
    if name in LEARNED:  # a trained policy on its own observation (not projected through decide)
        return lambda view, encoded, rng: controller.act(encoded.observation, encoded.mask)
    return controller_policy(controller)


def policy_inputs(env) -> tuple[CacheView, Encoded]:
    """What a policy reads from a live (``PagedKVCacheEnv``) or replay (``PagedKVCacheReplayEnv``) env now."""
    from kvgym.envs.replay import PagedKVCacheReplayEnv

    if isinstance(env, PagedKVCacheReplayEnv):
        return env.view(), env.encoded
    return CacheView.from_cache(env.cache, env.budget), env._encoded
