"""The trace-replay surrogate of the live environment: the same spaces and decision points, no model forward.

``PagedKVCacheReplayEnv`` steps a simulated block table through a recorded full-cache run (``kvgym/envs/traces.py``)
at thousands of decisions per second on a CPU, where the live env makes about one a second with SmolLM2. A policy
trained here is fine-tuned and validated on the live env (``eval.replay_compare.replay_live_correlation`` measures
how well the two agree).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from cache.controller import CacheView, Op
from cache.fallback import eviction_key
from cache.paged_cache import CacheConfig
from cache.runner import budget_blocks
from cache.tiers import Tier
from kvgym.envs.observation import (
    BLOCK_FEATURES,
    FALLBACK_RULE,
    NUM_OPS,
    Encoded,
    action_space,
    candidate_features,
    choose_candidates,
    observation_space,
    smallest_stable,
)
from kvgym.envs.reward import reward, reward_terms
from kvgym.envs.traces import Trace, trace_paths

DEVICE, HOST, DISK, DROPPED, UNUSED = (int(t) for t in (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.DROPPED, Tier.UNUSED))
SINK_BLOCKS = 1  # CacheConfig's default, as in the live env
RECENT_DECAY = 0.9  # CacheConfig's default (BlockStats.recent_mass)
ATTENDED_SHARE = 1.0  # CacheConfig's default (BlockStats.last_attended)
MAX_LOST = 1.0 - 1e-6  # keeps -log(1 - lost) finite
KEEP, EVICT, MERGE, PREFETCH = (int(op) for op in (Op.KEEP, Op.EVICT, Op.MERGE, Op.PREFETCH))
OP_NAMES = [op.name.lower() for op in Op]


def rank_in_group(groups: np.ndarray) -> np.ndarray:
    """Each entry's rank among the earlier entries with the same value: ``[3, 1, 3, 3] -> [0, 0, 1, 2]``."""
    order = np.argsort(groups, kind="stable")
    ordered = groups[order]
    rank = np.empty(len(groups), np.int64)
    rank[order] = np.arange(len(groups)) - np.searchsorted(ordered, ordered, side="left")
    return rank


class ReplayCacheInfo:
    """What controllers read from ``view.cache`` besides the view (its config and block size); one per episode,
    so controllers that remember their cache by identity see one cache per episode."""

    def __init__(self, num_layers: int):
        self.config = CacheConfig()
        self.block_size = self.config.block_size
        self.num_layers = num_layers


@dataclass
class ReplayCacheView(CacheView):
    """A ``CacheView`` of the replay env's simulated cache (``cache`` is a ``ReplayCacheInfo``): the lazy
    properties that read the live cache come from the trace instead (final mean keys, the recorded query,
    precomputed similarities)."""

    trace_mean_key: torch.Tensor | None = None
    trace_last_query: torch.Tensor | None = None
    trace_query_similarity: torch.Tensor | None = None
    trace_neighbour_similarity: torch.Tensor | None = None
    block_size: int = 16

    @cached_property
    def mean_key(self) -> torch.Tensor | None:
        return self.trace_mean_key

    @cached_property
    def key_min(self) -> torch.Tensor | None:
        return None  # not recorded

    @cached_property
    def key_max(self) -> torch.Tensor | None:
        return None  # not recorded

    @cached_property
    def last_query(self) -> torch.Tensor | None:
        return self.trace_last_query

    @cached_property
    def sentence_query(self) -> torch.Tensor | None:
        return None  # not recorded

    @cached_property
    def query_similarity(self) -> torch.Tensor:
        return self.trace_query_similarity

    @cached_property
    def neighbour_similarity(self) -> torch.Tensor:
        return self.trace_neighbour_similarity

    # traces record head-averaged mass: one "head" per layer, so ``mass(kind, "mean")`` is exact and
    # ``mass(kind, "max")`` is the mean; a decode forward's mass is its one query's (``last_query``)
    @cached_property
    def acc_mass_heads(self) -> torch.Tensor:
        return self.acc_mass[:, None, :]

    @cached_property
    def last_mass_heads(self) -> torch.Tensor:
        return self.last_mass[:, None, :]

    @cached_property
    def last_query_heads(self) -> torch.Tensor:
        return self.last_mass[:, None, :]

    @cached_property
    def query_max_heads(self) -> torch.Tensor | None:
        return None  # not recorded


class _Prepared:
    """A trace's arrays regrouped for the env's ``prefill_chunk``, with the derived similarities."""

    def __init__(self, trace: Trace, prefill_chunk: int, prefill_weight: float = 1.0):
        meta = trace.meta
        recorded_chunk = int(meta["prefill_chunk"])
        if prefill_chunk % recorded_chunk:
            raise ValueError(f"trace recorded with prefill_chunk {recorded_chunk}; the env's prefill_chunk "
                             f"{prefill_chunk} must be a multiple of it (rebuild the traces or change prefill_chunk)")
        if int(meta.get("block_size", 16)) != 16:
            raise ValueError("replay supports traces with 16-token blocks (the live env's block size)")
        self.meta = meta
        self.block_size = 16
        self.prompt_tokens = int(meta["prompt_tokens"])
        self.max_new_tokens = int(meta["max_new_tokens"])
        self.total_tokens = self.prompt_tokens + self.max_new_tokens
        self.bytes_per_token = int(meta["bytes_per_token"])
        recorded_prefill = trace.prefill_forwards
        group = prefill_chunk // recorded_chunk
        mass = trace.mass.float()
        queries = trace.queries.to(torch.float64)
        last_query = trace.last_query  # float16, as recorded
        # prefill: every `group` recorded chunks make one env chunk (mass and queries add up)
        starts = list(range(0, recorded_prefill, group))
        ends = [min(s + group, recorded_prefill) for s in starts]
        index = torch.tensor([e - 1 for e in ends] + list(range(recorded_prefill, trace.num_forwards)), dtype=torch.int64)
        if group > 1:
            prefill_mass = torch.stack([mass[s:e].sum(dim=0) for s, e in zip(starts, ends, strict=True)])
            prefill_queries = torch.stack([queries[s:e].sum() for s, e in zip(starts, ends, strict=True)])
            mass = torch.cat([prefill_mass, mass[recorded_prefill:]])
            queries = torch.cat([prefill_queries, queries[recorded_prefill:]])
        self.prefill_forwards = len(starts)
        self.seen = trace.seen[index].numpy().astype(np.int64)
        self.queries = queries.numpy().astype(np.float32)
        self.mass = np.ascontiguousarray(mass.numpy())  # [T, L, N] float32
        self.last_query = last_query[index]  # [T, L, heads, dim] float16 (the view reads one forward's, as float32)
        self.num_forwards, self.num_layers, self.num_blocks = self.mass.shape
        self.blocks_after = -(-self.seen // self.block_size)  # [T] logical blocks after each forward
        # weight of each forward in the KL proxy: prefill_weight per prefill chunk, 1 per decode step
        self.is_prefill = np.arange(self.num_forwards) < self.prefill_forwards
        self.scored = np.where(self.is_prefill, prefill_weight, 1.0).astype(np.float32)
        # the live env stops after the tokenizer's EOS (or max_new_tokens): tokens it will generate
        tokens = trace.tokens.tolist()
        eos = meta.get("eos_token_id")
        self.generated = len(tokens)
        if eos is not None and eos in tokens:
            self.generated = tokens.index(eos) + 1
        self.sentence_boundary = trace.sentence_boundary.numpy().astype(bool)
        mean_key = trace.mean_key.float()  # [L, N, kv_heads, dim]
        self.mean_key = mean_key
        kv_heads = mean_key.shape[2]
        # query similarity of every block at every forward: cosine(mean key, KV-group-averaged query), mean over
        # KV heads (CacheView.query_similarity)
        summary = last_query[index].float().reshape(self.num_forwards, self.num_layers, kv_heads, -1, last_query.shape[-1]).mean(dim=3)
        eps = 1e-8
        keys_n = mean_key / mean_key.norm(dim=-1, keepdim=True).clamp(min=eps)
        summary_n = summary / summary.norm(dim=-1, keepdim=True).clamp(min=eps)
        self.query_similarity = torch.einsum("lnhd,tlhd->tln", keys_n, summary_n).div_(kv_heads).numpy()
        # neighbour similarity: cosine between blocks' mean keys (KV heads concatenated); self-pairs set to -1
        flat = torch.nn.functional.normalize(mean_key.flatten(2), dim=-1)
        similarity = flat @ flat.transpose(1, 2)
        similarity.diagonal(dim1=1, dim2=2).fill_(-1.0)
        self.neighbour = similarity.numpy()  # [L, N, N]

    @property
    def nbytes(self) -> int:
        """Memory held by the prepared arrays."""
        return sum(value.nbytes if isinstance(value, np.ndarray) else value.element_size() * value.nelement()
                   for value in vars(self).values() if isinstance(value, (np.ndarray, torch.Tensor)))


class PreparedTraces:
    """Prepared traces by key, the least recently used dropped once their arrays pass a memory budget."""

    def __init__(self):
        self.entries: OrderedDict = OrderedDict()
        self.nbytes = 0

    def get(self, key, make, budget: int) -> _Prepared:
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        prepared = make()
        self.entries[key] = prepared
        self.nbytes += prepared.nbytes
        while self.nbytes > budget and len(self.entries) > 1:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes
        return prepared

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


# traces prepared from files, shared by every replay env of the process (a DummyVecEnv of N envs over one trace
# folder prepares each trace once and holds it once)
SHARED_TRACES = PreparedTraces()


class PagedKVCacheReplayEnv(gym.Env):
    """
    ## Description

    Trace replay of ``PagedKVCacheEnv`` (``kvgym/PagedKVCache-v0``): the same observation and action spaces, the
    same decision points (after every prefill chunk, every ``decide_every`` decode steps, whenever a layer goes
    over its budget), the same candidate selection and masks (``kvgym.envs.observation``), but no model: a
    simulated per-layer block table (device / host / dropped, host capacity ``host_blocks`` per layer, the sink
    block and the newest block pinned) evolves with the actions over a recorded full-cache run
    (``kvgym traces build``). After the agent's ops the same fallback rule as the cache's (evict the unpinned
    device blocks in ``cache.fallback.eviction_key`` order: H2O's recent window of ``budget // 2`` blocks last, the others by least
    accumulated attention; to the host if it has room, else dropped) enforces every
    layer's budget and is counted in ``info["fallbacks"]``.

    ## Dynamics

    - ``evict``: device → host if the layer's host pool has room (bytes moved: one block), else dropped.
    - ``merge``: the block is dropped (as in the cache: its slot is freed, no bytes move), but its future
      attention is credited: it counts as lost only by ``1 - merge_credit × max(neighbour similarity, 0)`` (the
      live merge folds its tokens into the most similar kept tokens, so part of their attention survives).
    - ``prefetch``: host → device (one block moved).
    - Statistics (``acc_mass``, ``recent_mass``, ``last_mass``, ``last_attended``): the trace's mass of each
      forward on the blocks that are on the device then, renormalised so it sums to the forward's query count per
      layer, as the live cache's attention only sees (and renormalises over) resident blocks; offloaded blocks
      accumulate nothing, exactly as in the live cache.
    - Key summaries are the trace's final mean keys (a full cache never changes a block; only the newest block's
      partial mean differs, and merged-into blocks keep their own mean); query similarity uses the recorded latest
      query of the forward before the decision.
    - Sentence boundaries: off by default, since the live env feeds no token ids to its cache (its observation's
      ``sentence_boundary`` is always 0); ``sentence_features=True`` uses the trace's.

    ## Rewards

    For forward ``t`` between this decision and the next, per layer ``l``: ``lost[t, l]`` = the full-cache
    attention mass of forward ``t`` on blocks that are not on the device (weighted by their loss weight: 1 evicted
    or dropped, less for merged) divided by its query count. Per step (``kvgym.envs.reward``, as the live env):

    ``reward = -kl - mass_scale × lost_mass - lambda_bytes × MB moved``, ``kl = kl_scale × kl_proxy``

    with ``lost_mass = Σ_t mean_l lost[t, l]`` and ``kl_proxy = Σ_t w_t × mean_l -log(1 - lost[t, l])``,
    ``w_t`` = 1 per decode step and ``prefill_weight`` per prefill chunk. ``-log(1 - p)`` is the exact KL between
    the attention distribution restricted to the kept blocks (renormalised) and the full one, when the kept part
    keeps its shape: the first-order effect of eviction on what a layer reads. ``kl_scale`` maps it to the live
    env's output KL: 20 was fitted on SmolLM2-135M, passkey at 1024 tokens (per-step least squares of the live
    KL on the proxy, r = 0.96 over 216 steps; the live KL sits on the decode steps, ~20 per unit of proxy, while
    a prefill chunk's ~7 per unit is what ``prefill_weight`` = 1/3 encodes; that fit predates the live env's
    teacher-forced KL, which is lower after a divergent token); ``eval.replay_compare.replay_live_correlation``
    returns the fit (``kl_scale_fit``) for another model or task. There is no task score (the answer is not
    decoded): ``info["task_score"]`` is 0. Components are in ``info``: ``kl`` (scaled, the live env's unit),
    ``kl_proxy``, ``lost_mass``, ``bytes_moved``, and the signed ``reward_terms``.

    ## Starting State

    A trace drawn with the env's RNG, a budget fraction drawn uniformly from ``budget_range`` (``reset(options=
    {"trace": i_or_Trace, "budget_fraction": f})`` picks them); the first prefill chunk has been replayed.

    ## Episode End

    ``terminated`` when the live env would have generated the answer: the trace's ``max_new_tokens`` or its
    first tokenizer EOS. ``truncated`` only by a ``TimeLimit`` wrapper.

    ## Arguments

    ``traces`` (a folder written by ``kvgym traces build``, a ``.pt`` file, a ``Trace``, or a list of them),
    ``num_candidates`` (K, 32), ``prefill_chunk`` (64; a multiple of the traces'), ``decide_every`` (8),
    ``budget_range``, ``lambda_bytes`` (0.01 per MB), ``host_blocks`` (None: room for the whole context),
    ``kl_scale`` (20.0), ``prefill_weight`` (1/3), ``mass_scale`` (0.0), ``merge_credit`` (0.5),
    ``sentence_features`` (False), ``trace_memory_gb`` (2.0: memory for prepared traces; the env prepares its
    traces once, when it is made, as many as fit, and the rest on first use, least recently used dropped first;
    traces from files are shared by every replay env of the process: ~10 MB each for SmolLM2 at 2k tokens,
    preparing one takes ~50 ms), ``render_mode`` (``"ansi"`` | ``"rgb_array"``).

    ## Version History

    * v0: initial version (trace replay of ``PagedKVCache-v0``).
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}

    def __init__(self, traces, num_candidates: int = 32, prefill_chunk: int = 64, decide_every: int = 8,
                 budget_range=(0.125, 0.5), lambda_bytes: float = 0.01, host_blocks: int | None = None,
                 kl_scale: float = 20.0, prefill_weight: float = 1.0 / 3.0, mass_scale: float = 0.0,
                 merge_credit: float = 0.5,
                 sentence_features: bool = False, trace_memory_gb: float = 2.0, render_mode: str | None = None):
        low, high = budget_range
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"budget_range {budget_range!r}: need 0 < low <= high <= 1")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r}: use one of {self.metadata['render_modes']}")
        if num_candidates < 1 or prefill_chunk < 1 or decide_every < 1:
            raise ValueError("num_candidates, prefill_chunk and decide_every must be >= 1")
        if not 0.0 <= merge_credit <= 1.0:
            raise ValueError(f"merge_credit must be in [0, 1], got {merge_credit}")
        if not trace_memory_gb > 0:
            raise ValueError(f"trace_memory_gb must be > 0, got {trace_memory_gb}")
        self.sources = self._sources(traces)
        self.num_candidates, self.prefill_chunk, self.decide_every = num_candidates, prefill_chunk, decide_every
        self.budget_range, self.lambda_bytes, self.host_blocks = (low, high), lambda_bytes, host_blocks
        self.kl_scale, self.prefill_weight, self.mass_scale = kl_scale, prefill_weight, mass_scale
        self.merge_credit, self.sentence_features, self.render_mode = merge_credit, sentence_features, render_mode
        self._decay = RECENT_DECAY ** np.arange(decide_every, dtype=np.float32)  # per forward of a replayed group
        self.trace_memory = int(trace_memory_gb * 2**30)
        self._own_traces = PreparedTraces()  # traces given as objects
        first = self._prepare(0)
        self.num_layers, size = first.num_layers, first.nbytes
        for index in range(1, len(self.sources)):  # prepare once, as many as fit; the others on first use
            if self._store(index).nbytes + size > self.trace_memory:
                break
            size = self._prepare(index).nbytes
        self.observation_space = observation_space(self.num_layers, num_candidates)
        self.action_space = action_space(num_candidates)
        self.data: _Prepared | None = None

    # ------------------------------------------------------------------ traces
    @staticmethod
    def _sources(traces) -> list:
        if isinstance(traces, (str, Path)):
            return list(trace_paths(traces))
        if isinstance(traces, (Trace, dict)):
            return [traces]
        sources = []
        for item in traces:
            sources += PagedKVCacheReplayEnv._sources(item) if isinstance(item, (str, Path)) else [item]
        if not sources:
            raise ValueError("traces: none given")
        return sources

    def _store(self, index: int) -> PreparedTraces:
        return SHARED_TRACES if isinstance(self.sources[index], Path) else self._own_traces

    def _prepare(self, key) -> _Prepared:
        """The prepared trace for a source index (from the store, or prepared and stored) or a ``Trace``/dict."""
        if not isinstance(key, int):
            trace = key if isinstance(key, Trace) else Trace.from_dict(key)
            return self._check(_Prepared(trace, self.prefill_chunk, self.prefill_weight))
        source = self.sources[key]
        if isinstance(source, Path):
            stat = source.stat()
            store_key = (str(source.resolve()), stat.st_mtime_ns, stat.st_size)
        else:
            store_key = key

        def make() -> _Prepared:
            trace = source if isinstance(source, Trace) else (
                Trace.from_dict(source) if isinstance(source, dict) else Trace.load(source))
            return _Prepared(trace, self.prefill_chunk, self.prefill_weight)

        store = self._store(key)
        return self._check(store.get((store_key, self.prefill_chunk, self.prefill_weight), make, self.trace_memory))

    def _check(self, prepared: _Prepared) -> _Prepared:
        layers = getattr(self, "num_layers", prepared.num_layers)
        if prepared.num_layers != layers:
            raise ValueError(f"trace has {prepared.num_layers} layers; the env's other traces have {layers}")
        return prepared

    # ------------------------------------------------------------------ episode
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        rng = self.np_random
        choice = options.get("trace")
        if choice is None:
            choice = int(rng.integers(len(self.sources)))
        fraction = options.get("budget_fraction")
        self.budget_fraction = float(rng.uniform(*self.budget_range) if fraction is None else fraction)
        self.data = data = self._prepare(choice)
        self.trace_index = choice if isinstance(choice, int) else -1
        L, N = data.num_layers, data.num_blocks
        total = data.total_tokens
        self.total_tokens = total
        self.budget = np.array(budget_blocks(self.budget_fraction, total, 16, L, SINK_BLOCKS + 1), dtype=np.int64)
        blocks_total = -(-total // 16)
        self.host_capacity = self.host_blocks if self.host_blocks is not None else blocks_total
        self.device_capacity = -(-(total + 1) // 16) + 1  # the live cache's device pool (max_blocks + 1)
        self.block_bytes = data.bytes_per_token * 16
        self.full_bytes = total * data.bytes_per_token * L
        self.tier = np.full((L, N), UNUSED, dtype=np.int8)
        self.loss_weight = np.zeros((L, N), np.float32)
        self.acc_mass = np.zeros((L, N), np.float32)
        self.recent_mass = np.zeros((L, N), np.float32)
        self.last_mass = np.zeros((L, N), np.float32)
        self.last_attended = np.full((L, N), -1, dtype=np.int64)
        self.device_count = np.zeros(L, np.int64)
        self.host_used = np.zeros(L, np.int64)
        self._cache_info = ReplayCacheInfo(L)
        self.n = 0  # logical blocks
        self.t = -1  # last replayed forward
        self.chunk_index, self.generated, self.done = 0, 0, False
        self.bytes_moved_total = 0
        kl, lost = self._advance()
        return self._observe(), self._info(kl=self.kl_scale * kl, kl_proxy=kl, lost_mass=lost, bytes_moved=0,
                                           fallbacks=0, task_score=0.0,
                                           ops={}, within_budget=True, illegal_ops=0)

    def _advance(self) -> tuple[float, float]:
        """Replay to the next decision point; returns (KL proxy, lost mass) on the way."""
        data = self.data
        if self.chunk_index < data.prefill_forwards:
            t = self.chunk_index
            self.chunk_index += 1
            return self._replay(t, t)
        first = last = None
        headroom = int((self.budget - self.device_count).min())
        for _ in range(self.decide_every):
            step = self.generated
            self.generated += 1
            if step + 1 >= data.generated:
                self.done = True
                break
            t = data.prefill_forwards + step
            first = t if first is None else first
            last = t
            if int(data.blocks_after[t]) - self.n > headroom:  # a layer went over its budget
                break
        if first is None:
            return 0.0, 0.0
        return self._replay(first, last)

    def _replay(self, t0: int, t1: int) -> tuple[float, float]:
        """Replay forwards ``t0..t1`` (no decision between them): loss, then the statistics."""
        data = self.data
        n0, n1 = self.n, int(data.blocks_after[t1])
        count0 = self.device_count.copy()
        if n1 > n0:  # new blocks are written to the device
            self.tier[:, n0:n1] = DEVICE
            self.device_count += n1 - n0
        self.n, self.t = n1, t1
        mass = data.mass[t0 : t1 + 1, :, :n1]  # [G, L, n]
        queries = data.queries[t0 : t1 + 1]  # [G] float32
        g = mass.shape[0]
        lost = np.einsum("gln,ln->gl", mass, self.loss_weight[:, :n1]) / queries[:, None]
        np.minimum(lost, MAX_LOST, out=lost)  # masses and loss weights are >= 0
        per_layer = 1.0 / lost.shape[1]
        kl = float(data.scored[t0 : t1 + 1] @ -np.log1p(-lost).sum(axis=1)) * per_layer
        lost_mass = float(lost.sum()) * per_layer
        # what the live cache's attention sees: the device blocks' mass, renormalised to the forward's queries
        resident_now = self.tier[:, :n1] == DEVICE
        on_device = resident_now.astype(np.float32)
        total = np.einsum("gln,ln->gl", mass, on_device)
        scale = np.divide(queries[:, None], total, out=np.zeros_like(total), where=total > 0)
        weights = self._decay[g - 1 :: -1, None] * scale
        self.acc_mass[:, :n1] += np.einsum("gl,gln->ln", scale, mass) * on_device
        self.recent_mass[:, :n1] *= np.float32(RECENT_DECAY ** g)
        self.recent_mass[:, :n1] += np.einsum("gl,gln->ln", weights, mass) * on_device
        # last_mass[:, n1:] stays 0: blocks past n1 do not exist yet (n only grows in an episode)
        np.multiply(mass[-1], scale[-1][:, None] * on_device, out=self.last_mass[:, :n1])
        resident = count0[None, :] + (data.blocks_after[t0 : t1 + 1] - n0)[:, None]  # [G, L]
        # attended: kept mass >= share × queries / resident blocks, i.e. raw mass >= that / scale
        threshold = np.divide(ATTENDED_SHARE * queries[:, None] / np.maximum(resident, 1), scale,
                              out=np.full_like(scale, np.inf), where=scale > 0)
        hit = mass >= threshold[..., None]
        hit &= resident_now
        if g == 1:
            np.copyto(self.last_attended[:, :n1], int(data.seen[t0]), where=hit[0])
        else:
            latest = np.where(hit, np.arange(g)[:, None, None], -1).max(axis=0)
            np.copyto(self.last_attended[:, :n1], data.seen[t0 + np.maximum(latest, 0)], where=latest >= 0)
        return kl, lost_mass

    # ------------------------------------------------------------------ observation
    def _pinned(self) -> np.ndarray:
        pinned = np.zeros((self.num_layers, self.n), bool)
        pinned[:, :SINK_BLOCKS] = True
        pinned[:, self.n - 1] = True
        return pinned

    def _unpin(self, on_device: np.ndarray) -> np.ndarray:
        """``on_device`` ``[L, n]`` (a fresh array, changed in place) less the pinned blocks: the evictable ones."""
        on_device[:, :SINK_BLOCKS] = False
        on_device[:, self.n - 1] = False
        return on_device

    def _observe(self) -> dict[str, np.ndarray]:
        """The observation from the simulated table, through the same candidate choice and features as the
        live env's ``encode`` (``tests/test_replay.py`` checks they agree)."""
        data, n, K, t = self.data, self.n, self.num_candidates, self.t
        tier = self.tier[:, :n]
        offloaded = (tier == HOST) | (tier == DISK)
        evictable = self._unpin(tier == DEVICE)
        query_similarity = data.query_similarity[t, :, :n]
        flat = choose_candidates(offloaded, evictable, query_similarity,
                                 eviction_key(self.acc_mass[:, :n], self.budget, FALLBACK_RULE),
                                 K)
        layers, blocks = np.divmod(flat, n)
        c = len(flat)
        features = np.zeros((K, len(BLOCK_FEATURES)), np.float32)
        mask = np.zeros((K, NUM_OPS), bool)
        mask[:, KEEP] = True
        if c:
            cand_tier = tier[layers, blocks]
            boundary = data.sentence_boundary[blocks] if self.sentence_features else np.zeros(c, bool)
            features[:c] = candidate_features(
                self.num_layers, int(data.seen[t]), layers, blocks * 16, cand_tier, self.acc_mass[layers, blocks],
                self.recent_mass[layers, blocks], query_similarity[layers, blocks],
                self.neighbour_rows(layers, blocks), boundary, (blocks < SINK_BLOCKS) | (blocks == n - 1))
            legal_evict = evictable[layers, blocks]
            mask[:c, EVICT] = legal_evict
            mask[:c, MERGE] = legal_evict & (self.device_count[layers] > 1)
            mask[:c, PREFETCH] = offloaded[layers, blocks] & (self.device_capacity - self.device_count[layers] > 0)
        self._layers, self._blocks, self._mask = layers, blocks, mask
        self._neighbour = features[:c, 6].copy()
        host_capacity = self.num_layers * self.host_capacity
        observation = {
            "layer_pressure": self.device_count.astype(np.float32) / np.maximum(self.budget, 1).astype(np.float32),
            "tier_occupancy": np.array([self.device_count.sum() / (self.num_layers * self.device_capacity),
                                        self.host_used.sum() / host_capacity if host_capacity else 0.0, 0.0],
                                       np.float32),
            "blocks": features.reshape(-1),
            "globals": np.array([int(data.seen[t]) / self.total_tokens, self.budget_fraction,
                                 self.bytes_moved_total / max(self.full_bytes, 1)], np.float32),
        }
        self._last_observation = observation
        return observation

    def neighbour_rows(self, layers: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Neighbour similarity of the given (layer, block)s: the best cosine to another device block, -1 if none."""
        n = self.n
        rows = self.data.neighbour[layers, blocks, :n]
        return np.where(self.tier[layers, :n] == DEVICE, rows, -1.0).max(axis=1) if n else np.full(len(layers), -1.0)

    @property
    def encoded(self) -> Encoded:
        """The current observation as ``observation.encode`` returns it (observation, mask, candidates)."""
        observation = self._last_observation
        return Encoded(observation={k: v.copy() for k, v in observation.items()}, mask=self._mask.copy(),
                       candidates=list(zip(self._layers.tolist(), self._blocks.tolist(), strict=True)))

    def view(self) -> ReplayCacheView:
        """A ``CacheView`` of the simulated cache (for controllers and checks; not used by ``step``)."""
        data, n, L = self.data, self.n, self.num_layers
        tier = torch.from_numpy(self.tier[:, :n].copy())
        on_device = tier == Tier.DEVICE
        neighbour = torch.from_numpy(np.where(self.tier[:, None, :n] == DEVICE, data.neighbour[:, :n, :n], -1.0)
                                     .max(axis=2) if n else np.zeros((L, 0), np.float32))
        counts = np.minimum(16, int(data.seen[self.t]) - 16 * np.arange(n))
        boundary = (torch.from_numpy(data.sentence_boundary[:n].copy()) if self.sentence_features
                    else torch.zeros(n, dtype=torch.bool))
        before = torch.cumsum(boundary.long(), 0) - boundary.long()
        budget = torch.from_numpy(self.budget.copy())
        queries = int(data.queries[self.t])
        return ReplayCacheView(
            cache=self._cache_info, seen=int(data.seen[self.t]), tier=tier,
            first_position=torch.arange(n, dtype=torch.int64) * 16,
            num_tokens=torch.from_numpy(np.broadcast_to(counts, (L, n)).astype(np.int32).copy()),
            pinned=torch.from_numpy(self._pinned()),
            acc_mass=torch.from_numpy(self.acc_mass[:, :n].copy()),
            recent_mass=torch.from_numpy(self.recent_mass[:, :n].copy()),
            last_mass=torch.from_numpy(self.last_mass[:, :n].copy()),
            last_attended=torch.from_numpy(self.last_attended[:, :n].copy()),
            sentence_id=before, sentence_boundary=boundary, budget_blocks=budget,
            pressure=on_device.sum(dim=1).float() / budget.clamp(min=1).float(),
            tier_occupancy=torch.from_numpy(self._last_observation["tier_occupancy"].copy()),
            device_free=torch.from_numpy(self.device_capacity - self.device_count),
            forward_tokens=queries, forward_queries=queries, sentence_length=0,
            trace_mean_key=data.mean_key[:, :n], trace_last_query=data.last_query[self.t],
            trace_query_similarity=torch.from_numpy(data.query_similarity[self.t, :, :n].copy()),
            trace_neighbour_similarity=neighbour.float(), block_size=16,
        )

    def _info(self, **values) -> dict:
        return {**values, "action_mask": self._mask.astype(np.int8), "budget_fraction": self.budget_fraction,
                "seen": int(self.data.seen[self.t]), "device_blocks": int(self.device_count.sum())}

    def action_masks(self) -> np.ndarray:
        """Flat ``[K * 4]`` bool mask of legal ops (sb3-contrib's ``MaskablePPO`` calls this)."""
        return self._mask.reshape(-1).copy()

    # ------------------------------------------------------------------ step
    def step(self, action):
        if self.data is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("the episode has ended; call reset()")
        action = np.asarray(action)
        assert (action.shape == (self.num_candidates,) and np.issubdtype(action.dtype, np.integer)
                and action.min() >= 0 and action.max() < NUM_OPS), f"invalid action {action!r}"
        action = action.astype(np.int64, copy=False)
        moved, illegal, ops = self._apply(action)
        fallbacks, fallback_moved = self._enforce_budget()
        moved += fallback_moved
        within_budget = bool((self.device_count <= self.budget).all())
        self.bytes_moved_total += moved
        kl, lost = self._advance()
        terms = reward_terms(self.kl_scale * kl, moved, lost_mass=lost, lambda_bytes=self.lambda_bytes,
                             mass_scale=self.mass_scale)
        observation = self._observe()
        info = self._info(kl=self.kl_scale * kl, kl_proxy=kl, lost_mass=lost, bytes_moved=moved, fallbacks=fallbacks,
                          task_score=0.0, ops=ops, within_budget=within_budget, illegal_ops=illegal,
                          reward_terms=terms)
        return observation, reward(terms), self.done, False, info

    def _apply(self, action: np.ndarray) -> tuple[int, int, dict[str, int]]:
        """The agent's ops, evictions and merges first (slot order), then prefetches (as ``decode_action``): an
        eviction goes to the host while its layer's host pool has room (in slot order), else it is dropped."""
        c = len(self._layers)
        ops = dict.fromkeys(OP_NAMES, 0)
        chosen = action[:c]
        illegal = int(np.count_nonzero(action[c:]))
        active = chosen != KEEP
        if not active.any():
            return 0, illegal, ops
        legal = self._mask[np.arange(c), chosen]
        illegal += int(np.count_nonzero(active & ~legal))
        chosen = np.where(legal, chosen, KEEP)
        layers, blocks, L = self._layers, self._blocks, self.num_layers
        moved = 0
        evict = np.flatnonzero(chosen == EVICT)
        if len(evict):
            layer = layers[evict]
            to_host = rank_in_group(layer) < (self.host_capacity - self.host_used)[layer]
            self.tier[layer, blocks[evict]] = np.where(to_host, HOST, DROPPED)
            self.loss_weight[layer, blocks[evict]] = 1.0
            self.host_used += np.bincount(layer[to_host], minlength=L)
            self.device_count -= np.bincount(layer, minlength=L)
            moved += int(np.count_nonzero(to_host)) * self.block_bytes
        merge = np.flatnonzero(chosen == MERGE)
        if len(merge):
            layer = layers[merge]
            self.tier[layer, blocks[merge]] = DROPPED
            credit = self.merge_credit * np.maximum(self._neighbour[merge].astype(np.float64), 0.0)
            self.loss_weight[layer, blocks[merge]] = 1.0 - credit
            self.device_count -= np.bincount(layer, minlength=L)
        prefetch = np.flatnonzero(chosen == PREFETCH)
        if len(prefetch):
            layer = layers[prefetch]
            self.tier[layer, blocks[prefetch]] = DEVICE
            self.loss_weight[layer, blocks[prefetch]] = 0.0
            self.host_used -= np.bincount(layer, minlength=L)
            self.device_count += np.bincount(layer, minlength=L)
            moved += len(prefetch) * self.block_bytes
        for op, slots in ((EVICT, evict), (MERGE, merge), (PREFETCH, prefetch)):
            ops[OP_NAMES[op]] = len(slots)
        return moved, illegal, ops

    def _enforce_budget(self) -> tuple[int, int]:
        """The cache's fallback (``heavy_recent``): per layer over budget, evict the unpinned device blocks in
        ``cache.fallback.eviction_key`` order (least accumulated mass first, the recent window last; ties:
        oldest), to the host while it has room, else dropped."""
        excess = np.maximum(self.device_count - self.budget, 0)
        if not excess.any():
            return 0, 0
        n = self.n
        evictable = self._unpin(self.tier[:, :n] == DEVICE)
        layer_index, blocks, rank = smallest_stable(
            np.where(evictable, eviction_key(self.acc_mass[:, :n], self.budget, FALLBACK_RULE), np.inf), excess)
        to_host = rank < (self.host_capacity - self.host_used)[layer_index]
        self.tier[layer_index, blocks] = np.where(to_host, HOST, DROPPED).astype(np.int8)
        self.loss_weight[layer_index, blocks] = 1.0
        L = self.num_layers
        self.host_used += np.bincount(layer_index[to_host], minlength=L)
        self.device_count -= np.bincount(layer_index, minlength=L)
        return len(blocks), int(to_host.sum()) * self.block_bytes

    # ------------------------------------------------------------------ render
    def render(self):
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode='ansi' or 'rgb_array'")
            return None
        tiers = self.tier[:, : self.n]
        if self.render_mode == "ansi":
            symbols = {DEVICE: "D", HOST: "h", DISK: "d", DROPPED: "."}
            rows = [f"L{layer:02d} " + "".join(symbols.get(int(t), "?") for t in tiers[layer])
                    for layer in range(self.num_layers)]
            return "\n".join(rows) + f"\nseen {int(self.data.seen[self.t])} tokens, budget {self.budget[0]} blocks/layer\n"
        colours = np.array([[46, 204, 113], [52, 152, 219], [155, 89, 182], [40, 40, 40]], np.uint8)
        image = colours[np.clip(tiers, 0, None).astype(np.int64)]
        return np.repeat(np.repeat(image, 4, axis=0), 4, axis=1)

    def close(self):
        self._own_traces.clear()
