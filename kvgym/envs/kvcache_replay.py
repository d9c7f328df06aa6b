"""``kvgym/KVCacheReplay-v1``: ``KVCache-v1``'s spaces and multi-step episodes, replayed from recorded full-cache
runs without a model (thousands of steps per second), for training on what the one-step replay cannot show:
bytes moved, and choices that carry over from one decision point to the next.

**Recording** (``record_episode``): the sample runs once with the full cache through the same runner and protocol
(``streaming`` or ``multiturn``), a decision after every forward pass. At each forward pass that is a decision
point of the live env (every prefill chunk, the question, decode step 0 and every ``decide_every`` steps, and a
decode step that starts a new block, where a live cache at its budget goes over it) the recorder keeps every
block's ranking features (``cache.ranking.policy_features`` of the full cache's view); between two decision
points it sums the attention each block receives from every query (per query head; the **future mass** of the
earlier point is its max over heads).

**Replay** (``KVCacheReplayEnv``): the tiers of every block are the episode's state. A step applies the action as
``keep_top`` does: each layer keeps its pinned blocks (the sinks and the newest) and its highest keep scores up
to its budget; a block that falls out goes to the host tier while it has room, else it is dropped (gone for
good); a host block that rises in is prefetched. New blocks arrive on the device. The observation is the
recorded features with what the replay's state decides written over them (valid, tier, layer pressure and
budget; the latest forward's attention, which a live cache sees for resident blocks only: zero for the others, the
residents' shares renormalised and ranked again; ``layers`` and ``globals`` as the live env computes them).
``budget_scope="global"``: only the total over layers holds, as in the live env (the highest scores over all layers
stay; a layer's budget column is the allocation the last decision left it). The
accumulated attention and the key features stay the full cache's: the approximation
``benchmarks/replay_fidelity_v1.py`` measures against live returns. Reward per step: minus ``mass_weight`` times the share of the future mass that falls on blocks off the
device until the next decision point (mean over layers), minus ``transfer_cost`` per MB moved, per tier pair as
in the live env. No answer is decoded; a merge (live: the block folded into its neighbours) is replayed as a drop.
"""

from __future__ import annotations

import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from cache.controller import PHASES, CacheView
from cache.paged_cache import CacheConfig
from cache.ranking import (
    BUDGET_COLUMN,
    PRESSURE_COLUMN,
    RANK_FEATURES,
    policy_features,
    top_b,
    within_layer_rank,
)
from cache.runner import BUDGET_SCOPES, Runner
from cache.tiers import Tier
from kvgym.envs.kvcache import checked_action, spaces_of, transfer_costs

VALID_COLUMN = RANK_FEATURES.index("valid")
TIER_COLUMNS = [RANK_FEATURES.index(f"tier_{name}") for name in ("device", "host", "disk")]
# the latest forward's attention (window and last query, mean and max over heads): a live cache sees it for its
# resident blocks only, so the replay takes it away from the others (share and rank columns of each)
SHARE_COLUMNS = [RANK_FEATURES.index(f"{kind}_{over}_log_share") for kind in ("last", "last_query") for over in ("mean", "max")]
RANK_COLUMNS = [RANK_FEATURES.index(f"{kind}_{over}_rank") for kind in ("last", "last_query") for over in ("mean", "max")]
EPISODE_FORMAT = "kvgym-replay-episode"
NOT_YET = -1  # a block the run has not reached yet
DEVICE, HOST, DISK, DROPPED = (int(t) for t in (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.DROPPED))  # plain ints: fast


class _Recorder:
    """The full-cache run's controller: features at the live env's decision points, attention between them."""

    def __init__(self, decide_every: int):
        self.decide_every = decide_every
        self.points: list[dict] = []
        self._pending: torch.Tensor | None = None  # [L, H, N] summed since the last decision point
        self._decode_step, self._blocks = 0, 0
        self.block_bytes = 0

    def _close(self) -> None:
        if self.points and self._pending is not None:
            self.points[-1]["future"] = self._pending.amax(dim=1).float().numpy()
        self._pending = None

    def decide(self, view: CacheView) -> list:
        self.block_bytes = view.cache.pools[0][Tier.DEVICE].bytes_per_block
        heads = view.last_mass_heads
        if heads is not None and self.points:
            heads = heads.double()
            if self._pending is not None:
                grown = torch.zeros(heads.shape, dtype=torch.float64)
                grown[..., : self._pending.shape[-1]] = self._pending
                heads = heads + grown
            self._pending = heads
        if view.phase == "decode":
            live = self._decode_step % self.decide_every == 0 or view.num_blocks > self._blocks
            self._decode_step += 1
        else:
            live, self._decode_step = True, 0
        self._blocks = view.num_blocks
        if live:
            self._close()
            self.points.append({"features": torch.from_numpy(policy_features(view)).half(), "phase": view.phase,
                                "question_read": bool(view.question_read), "seen": int(view.seen)})
        return []

    def finish(self) -> list[dict]:
        self._close()
        last = self.points[-1] if self.points else None
        if last is not None and "future" not in last:
            last["future"] = np.zeros(last["features"].shape[:2], np.float32)
        return self.points


def record_episode(model, tokenizer, prompt, max_new_tokens: int, protocol: str = "streaming", block_size: int = 16,
                   prefill_chunk: int = 64, decide_every: int = 8, meta: dict | None = None) -> dict:
    """One sample's recorded full-cache run (see the module docstring) as a dict ``torch.save`` can write."""
    if protocol not in ("streaming", "multiturn"):
        raise ValueError(f"protocol {protocol!r}: the replay twin records streaming or multiturn episodes (one-shot "
                         "decisions replay in kvgym.envs.decisions.RankingReplayEnv)")
    total = len(prompt.ids) + sum(len(t) for t in prompt.turns) + (len(prompt.turns) + 1) * max_new_tokens
    config = CacheConfig(block_size=block_size, stats_window=max(64, prefill_chunk))
    recorder = _Recorder(decide_every)
    runner = Runner(model, tokenizer, cache_config=config, controller=recorder,
                    budget=max(-(-total // block_size), config.sink_blocks + 1), prefill_chunk=prefill_chunk,
                    decide_every=1, protocol=protocol)
    result = runner.run(prompt, max_new_tokens=max_new_tokens)
    if result.operations.get("evict", 0) or result.fallbacks:
        raise RuntimeError("record_episode: the full cache's run evicted blocks")
    points = recorder.finish()
    return {"format": EPISODE_FORMAT, "features": [p["features"] for p in points],
            "future": [torch.from_numpy(p["future"]) for p in points], "phases": [p["phase"] for p in points],
            "question_read": [p["question_read"] for p in points], "seen": [p["seen"] for p in points],
            "context_tokens": int(prompt.context_tokens), "total_tokens": int(total),
            "num_layers": model.config.num_hidden_layers, "block_bytes": recorder.block_bytes, "block_size": block_size,
            "sink_blocks": config.sink_blocks, "protocol": protocol, "text": result.text, **(meta or {})}


def record_episodes(model, tokenizer, tasks: list[str], lengths: list[int], n: int, seed: int, out: str | Path,
                    protocol: str = "streaming", chat: bool = False, block_size: int = 16, prefill_chunk: int = 64,
                    decide_every: int = 8, log=print) -> list[Path]:
    """``n`` samples per task × length recorded into ``out`` (one ``.pt`` each; existing files are kept, so a killed
    recording resumes). The samples are ``kvgym eval --seed seed``'s (``eval.tasks.base.sample_seed``), so a live
    run of the same sample is ``KVCacheEnv.reset(options={"sample_seed": ..., "index": ...})`` with the episode's
    ``sample_seed`` and ``index``."""
    from eval.tasks.base import get_task, sample_seed
    from eval.tasks.prompt import build_prompt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in tasks:
        for length in lengths:
            for index in range(n):
                path = out / f"{task}_{length}_eval{seed}_{index}_{protocol}{'_chat' if chat else ''}.pt"
                paths.append(path)
                if path.exists():
                    continue
                drawn = sample_seed(seed, task, length, index)
                sample = get_task(task)(tokenizer, length, drawn, index)
                prompt = build_prompt(tokenizer, sample, chat)
                meta = {"task": task, "length": length, "seed": seed, "index": index, "sample_seed": drawn, "chat": chat}
                episode = record_episode(model, tokenizer, prompt, sample.max_new_tokens, protocol, block_size,
                                         prefill_chunk, decide_every, meta)
                tmp = path.with_suffix(".tmp")
                torch.save(episode, tmp)
                tmp.replace(path)
                log(f"{path.name}: {len(episode['features'])} decision points")
    return paths


def load_episodes(source) -> list[dict]:
    """Episodes from a folder of ``record_episodes``' files, a list of paths, or a list of episode dicts."""
    if isinstance(source, (str, Path)):
        folder = Path(source)
        paths = sorted(folder.glob("*.pt")) if folder.is_dir() else []
        if not paths:
            raise ValueError(f"episodes {source}: no recorded episodes (.pt) there; record them with "
                             "kvgym.envs.kvcache_replay.record_episodes")
        source = paths
    episodes = []
    for item in source:
        if isinstance(item, dict):
            episode = item
        else:
            try:
                episode = torch.load(item, weights_only=True)
            except Exception as error:  # noqa: BLE001  (torch raises many kinds for a damaged file)
                raise ValueError(f"{item}: not a recorded episode ({type(error).__name__}); record it again") from None
        if not isinstance(episode, dict) or episode.get("format") != EPISODE_FORMAT:
            raise ValueError(f"{item if not isinstance(item, dict) else 'an episode'}: not a recorded episode")
        episodes.append(episode)
    if not episodes:
        raise ValueError("episodes: none given")
    return episodes


def _shares(features: np.ndarray) -> np.ndarray:
    """``[len(SHARE_COLUMNS), L, N]`` float64: the latest forward's attention shares back from their log_share
    columns (``log(N · share + 1e-4)``; the scale cancels when the replay renormalises them)."""
    stacked = np.moveaxis(features[..., SHARE_COLUMNS], -1, 0).astype(np.float64)
    return np.maximum(np.exp(stacked) - 1e-4, 0.0)


class KVCacheReplayEnv(gym.Env):
    """See the module docstring. ``episodes``: a folder, paths or dicts (``load_episodes``); ``max_tokens`` fixes
    the observation's block axis as the live env's does (default: the longest episode's)."""

    metadata = {"render_modes": []}

    def __init__(self, episodes, budget_range=(0.125, 0.5), host_blocks: int = 0, transfer_cost: float | dict = 0.0,
                 mass_weight: float = 1.0, max_tokens: int | None = None, budget_scope: str = "layer"):
        if budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"budget_scope {budget_scope!r}: choose one of {', '.join(BUDGET_SCOPES)}")
        self.budget_scope = budget_scope
        self.episodes = load_episodes(episodes)
        low, high = budget_range
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"budget_range {budget_range!r}: need 0 < low <= high <= 1")
        if isinstance(host_blocks, bool) or not isinstance(host_blocks, int) or host_blocks < 0:
            raise ValueError(f"host_blocks {host_blocks!r}: must be an integer >= 0")
        costs = transfer_costs(transfer_cost, mass_weight=mass_weight)
        # numpy once (the steps read them thousands of times), float32 features and the latest forward's attention
        # shares decoded from their log_share columns; the caller's dicts untouched
        self.episodes = [{**episode, "features": [np.asarray(f, np.float32) for f in episode["features"]],
                          "future": [np.asarray(f, np.float64) for f in episode["future"]],
                          "shares": [_shares(np.asarray(f, np.float32)) for f in episode["features"]]}
                         for episode in self.episodes]
        first = self.episodes[0]
        self.num_layers, self.block_size = first["num_layers"], first["block_size"]
        self.max_tokens = max_tokens or max(int(1.25 * e["total_tokens"]) + 256 for e in self.episodes)
        self.max_blocks = math.ceil(self.max_tokens / self.block_size)
        if max(f.shape[1] for e in self.episodes for f in e["features"]) > self.max_blocks:
            raise ValueError(f"max_tokens {self.max_tokens}: an episode holds more blocks than the observation")
        self.budget_range, self.host_blocks, self.mass_weight = (low, high), host_blocks, float(mass_weight)
        self.transfer_cost = costs
        self.observation_space, self.action_space = spaces_of(self.num_layers, self.max_blocks)
        self._episode: dict | None = None

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = dict(options or {})
        unknown = sorted(set(options) - {"episode", "budget"})
        if unknown:
            raise ValueError(f"reset options {unknown}: the options are episode (an index) and budget")
        index = int(options.get("episode", self.np_random.integers(len(self.episodes))))
        if not 0 <= index < len(self.episodes):
            raise ValueError(f"reset option episode {index}: this env holds {len(self.episodes)} episodes")
        budget = float(options.get("budget", self.np_random.uniform(*self.budget_range)))
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"reset option budget {budget!r}: a fraction in (0, 1]")
        episode = self._episode = self.episodes[index]
        self._budget = budget
        blocks = math.ceil(budget * episode["context_tokens"] / self.block_size)
        self._budget_blocks = max(blocks, episode["sink_blocks"] + 1)
        # each layer's budget: the same for all, or under a global budget the allocation the last decision left (the
        # live runner's: each layer's device blocks after a decision that kept the total)
        self._allocation = np.full(self.num_layers, self._budget_blocks)
        self._tier = np.full((self.num_layers, self.max_blocks), NOT_YET, np.int8)
        self._point, self._moved_mb = 0, 0.0
        self._arrive()
        info = {"episode": index, "budget": budget, "task": episode.get("task"), "steps": len(episode["features"])}
        return self._observation(), info

    def step(self, action):
        if self._episode is None:
            raise gym.error.ResetNeeded("step() before reset() or after the episode ended: call reset()")
        action = checked_action(action, self.action_space)
        episode, point = self._episode, self._point
        moved = self._apply(action[:, :, 0], action[:, :, 1])
        lost = self._lost_share(episode["future"][point])
        mb = {pair: count * episode["block_bytes"] / 1e6 for pair, count in moved.items()}
        cost = sum(self.transfer_cost[pair] * value for pair, value in mb.items())
        self._moved_mb += sum(mb.values())
        reward = -self.mass_weight * lost - cost
        info = {"lost_mass": lost, "mb_moved": sum(mb.values()), "transfer_cost": cost}
        self._point += 1
        if self._point >= len(episode["features"]):
            observation = self._observation(point)
            self._episode = None
            return observation, float(reward), True, False, info
        self._arrive()
        return self._observation(), float(reward), False, False, info

    # ------------------------------------------------------------------ replay mechanics
    def _arrive(self) -> None:
        """Blocks the run reached since the last decision point arrive on the device."""
        n = self._episode["features"][self._point].shape[1]
        tier = self._tier[:, :n]
        tier[tier == NOT_YET] = DEVICE

    def _pinned(self, n: int) -> np.ndarray:
        pinned = np.zeros((self.num_layers, n), bool)
        pinned[:, : self._episode["sink_blocks"]] = True
        pinned[:, n - 1] = True
        return pinned

    def _apply(self, scores: np.ndarray, merge: np.ndarray) -> dict[str, int]:
        """``keep_top``'s rule on the replay's tiers; returns the blocks moved per tier pair. A block that leaves
        with a merge logit > 0 is merged live (folded into its neighbours: no bytes move); here it is dropped."""
        n = self._episode["features"][self._point].shape[1]
        tier, pinned = self._tier[:, :n], self._pinned(n)
        live = tier != DROPPED
        candidates = live & ~pinned
        keyed = np.where(candidates, scores[:, :n], -np.inf)  # float32, the action's: top_b's fast sort
        if self.budget_scope == "layer":
            chosen = top_b(keyed, candidates, self._budget_blocks - (pinned & live).sum(axis=1))
        else:  # the highest scores over all layers up to the total: the scores decide each layer's share
            room = self.num_layers * self._budget_blocks - int((pinned & live).sum())
            chosen = top_b(keyed.reshape(1, -1), candidates.reshape(1, -1), np.array([room])).reshape(keyed.shape)
        leaving = (tier == DEVICE) & candidates & ~chosen
        arriving = chosen & (tier == HOST)
        merged = leaving & (merge[:, :n] > 0)
        evicted = leaving & ~merged
        tier[arriving] = DEVICE  # prefetches free their host slots first, as keep_top orders them
        host_free = np.maximum(self.host_blocks - (tier == HOST).sum(axis=1), 0)
        to_host = evicted & (np.cumsum(evicted, axis=1) <= host_free[:, None])
        tier[to_host] = HOST
        tier[leaving & ~to_host] = DROPPED
        if self.budget_scope == "global":
            self._allocation = (tier == DEVICE).sum(axis=1)
        return {"host->device": int(arriving.sum()), "device->host": int(to_host.sum())}

    def _lost_share(self, future: np.ndarray) -> float:
        """Share of each layer's future mass on blocks off the device (blocks the interval creates count as on it)."""
        n = min(future.shape[1], self.max_blocks)
        tier = self._tier[:, :n]
        off = (tier != DEVICE) & (tier != NOT_YET)
        total = future[:, :n].sum(axis=1)
        lost = np.where(off, future[:, :n], 0.0).sum(axis=1)
        return float(np.mean(np.where(total > 0, lost / np.where(total > 0, total, 1.0), 0.0)))

    def _observation(self, point: int | None = None) -> dict:
        episode = self._episode
        point = self._point if point is None else point
        features = episode["features"][point]
        n = features.shape[1]
        tier = self._tier[:, :n]
        blocks = np.zeros(self.observation_space["blocks"].shape, np.float32)
        blocks[:, :n] = features
        valid = tier != DROPPED
        existing = np.maximum(valid.sum(axis=1), 1)
        on = [tier == value for value in (DEVICE, HOST, DISK)]
        device = on[0].sum(axis=1)
        blocks[:, :n, VALID_COLUMN] = valid
        for column, where in zip(TIER_COLUMNS, on, strict=True):
            blocks[:, :n, column] = where
        off = ~on[0]
        if off.any():  # the recorded shares with the off-device ones zeroed, renormalised and ranked again
            shares = np.where(off | ~valid, 0.0, episode["shares"][point])
            total = shares.sum(axis=-1, keepdims=True)
            logs = np.log(shares / np.where(total > 0, total, 1.0) * n + 1e-4)
            blocks[:, :n, SHARE_COLUMNS] = np.moveaxis(np.where(valid, logs, np.log(1e-4)), 0, -1)
            # ranked as float32, as the live masses are (and by the fast stable sort)
            blocks[:, :n, RANK_COLUMNS] = np.moveaxis(within_layer_rank(shares.astype(np.float32), valid), 0, -1)
        allocation = self._allocation
        blocks[:, :n, PRESSURE_COLUMN] = (device / np.maximum(allocation, 1))[:, None]
        blocks[:, :n, BUDGET_COLUMN] = (allocation / max(n, 1))[:, None]
        mask = np.zeros(self.observation_space["mask"].shape, np.float32)
        mask[:, :n] = valid
        layers = np.stack([device / np.maximum(allocation, 1), allocation / existing,
                           *[where.sum(axis=1) / existing for where in on]], axis=1).astype(np.float32)
        glob = np.array([*[float(episode["phases"][point] == p) for p in PHASES], float(episode["question_read"][point]),
                         episode["seen"][point] / max(episode["total_tokens"], 1), self._budget, self._moved_mb],
                        np.float32)
        return {"blocks": blocks, "mask": mask, "layers": layers, "globals": glob}
