"""Oracle: a Belady-like upper bound for eviction that knows each block's future attention.

A reference pass runs the same token sequence with the full cache and records, after every forward pass
(each prefill chunk, each decode step), the attention mass each block received (``AttentionTrace``). At a
decision point of the evaluated run, identified by the tokens seen so far, ``Oracle`` evicts from each layer
over budget the blocks with the least attention still to come: the sum of their recorded mass over every
later forward pass (or over the next ``horizon`` tokens). It is a heuristic bound, not an optimum: mass is
measured with the full cache (attention renormalises once blocks leave), and an evicted block is gone.

- Blocks: the cache records attention per block already (query-head averaged, summed over the block's
  tokens and the forward's queries); the reference pass uses ``stats_window = prefill_chunk`` so every
  prefill query is recorded, not only each chunk's last 64.
- GQA: group-averaged, as the cache's statistics (one score per block and layer for all KV heads).
- Exactness: exact for the prompt and for teacher-forced text. For generated tokens the trace holds the full
  cache's greedy continuation; a budgeted run that generates different tokens is scored by the full cache's
  future attention (an approximation). Decision points must fall on the reference pass's forward
  boundaries (same ``prefill_chunk``); past the end of the trace (e.g. the reference stopped at EOS earlier)
  nothing is known and blocks are evicted by accumulated mass.
- Without a trace (``Oracle()``, as the registry builds it), it is not an oracle: it evicts by accumulated
  attention mass (``acc_mass``, H2O's score without a recent window) and warns once. Build the real one with
  ``Oracle.from_run(model, ids, max_new_tokens, prefill_chunk)``, or record any loop with ``TraceRecorder``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cached_property

import torch

from agents.baselines.base import evict, excess_blocks, lowest_scoring
from cache.controller import CacheView, Decision
from cache.paged_cache import CacheConfig


@dataclass
class AttentionTrace:
    """Per forward pass ``t`` of a full-cache run: ``seen[t]`` tokens seen after it and ``mass[t]``
    ``[L, N]`` the attention mass each block received in it. ``tokens``: the run's generated tokens."""

    seen: torch.Tensor  # [T] int64, increasing
    mass: torch.Tensor  # [T, L, N] float32
    tokens: list[int] = field(default_factory=list)

    @cached_property
    def _cumulative(self) -> torch.Tensor:
        """``[T + 1, L, N]`` float64 prefix sums of ``mass`` (exact differences over zero stretches)."""
        zero = torch.zeros(1, *self.mass.shape[1:], dtype=torch.float64)
        return torch.cat([zero, self.mass.double().cumsum(dim=0)])

    def future_mass(self, seen: int, horizon: int | None = None) -> torch.Tensor | None:
        """``[L, N]`` mass received by each block in the forward passes after the one that brought the run to
        ``seen`` tokens (those ending at most ``horizon`` tokens later, when set); None past the trace's end."""
        last = int(self.seen[-1])
        if seen >= last:
            return None if seen > last else torch.zeros(self.mass.shape[1:])
        start = int(torch.searchsorted(self.seen, seen, right=True))
        if start == 0 or int(self.seen[start - 1]) != seen:
            raise ValueError(
                f"Oracle: no forward pass of the reference run ends at {seen} tokens (its forwards end at "
                f"{self.seen[:8].tolist()}...); record the trace with the same prompt and prefill_chunk as the run")
        end = len(self.seen) if horizon is None else int(torch.searchsorted(self.seen, seen + horizon, right=True))
        return (self._cumulative[end] - self._cumulative[start]).float()


class TraceRecorder:
    """A controller that records ``view.last_mass`` at every decision point and evicts nothing. Run it where
    a decision follows every forward pass and no block leaves the device (``record_trace`` does this with the
    runner); ``trace()`` returns the ``AttentionTrace``."""

    def __init__(self):
        self.seen: list[int] = []
        self.masses: list[torch.Tensor] = []

    def decide(self, view: CacheView) -> list[Decision]:
        if self.seen and view.seen <= self.seen[-1]:
            raise ValueError(f"TraceRecorder: tokens seen went from {self.seen[-1]} to {view.seen}; "
                             "record one run, one decision per forward pass")
        self.seen.append(view.seen)
        self.masses.append(view.last_mass.clone())
        return []

    def trace(self, tokens: list[int] | None = None) -> AttentionTrace:
        if not self.masses:
            raise ValueError("TraceRecorder: nothing recorded")
        num_layers, width = self.masses[-1].shape[0], max(m.shape[1] for m in self.masses)
        mass = torch.zeros(len(self.masses), num_layers, width)
        for t, m in enumerate(self.masses):
            mass[t, :, : m.shape[1]] = m
        return AttentionTrace(torch.tensor(self.seen, dtype=torch.int64), mass, list(tokens or []))


def record_trace(model, input_ids, max_new_tokens: int = 64, prefill_chunk: int = 64, tokenizer=None,
                 cache_config: CacheConfig | None = None, stop_at_eos: bool = True) -> AttentionTrace:
    """The full cache's attention trace of ``input_ids`` + greedy decode, with the runner's forward passes
    (prefill in ``prefill_chunk`` chunks, then one token a step)."""
    from cache.runner import Runner

    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    config = cache_config or CacheConfig()
    config = CacheConfig(**{**config.__dict__, "stats_window": max(config.stats_window, prefill_chunk)})
    total = ids.shape[1] + max_new_tokens
    budget = max(-(-total // config.block_size), config.sink_blocks + 1)  # the whole run fits: no eviction
    recorder = TraceRecorder()
    runner = Runner(model, tokenizer, cache_config=config, controller=recorder, budget=budget,
                    prefill_chunk=prefill_chunk, decide_every=1)
    result = runner.run(ids, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos)
    if result.operations.get("evict", 0) or result.fallbacks:
        raise RuntimeError("record_trace: the reference run evicted blocks; it must keep the full cache")
    return recorder.trace(result.new_tokens)


@dataclass
class Oracle:
    # its trace is a full-cache run with the same forward passes: recorded under the streaming protocol only
    protocols = ("streaming",)
    horizon: int | None = None  # tokens of future attention summed; None: the rest of the run
    trace: AttentionTrace | None = field(default=None, repr=False)

    @classmethod
    def from_run(cls, model, input_ids, max_new_tokens: int = 64, prefill_chunk: int = 64,
                 horizon: int | None = None, **kwargs) -> Oracle:
        """An oracle for runs of ``input_ids`` with this ``max_new_tokens`` and ``prefill_chunk`` (pass the
        same to the runner); ``kwargs`` go to ``record_trace`` (``tokenizer``, ``cache_config``, ...)."""
        return cls(horizon=horizon, trace=record_trace(model, input_ids, max_new_tokens, prefill_chunk, **kwargs))

    def decide(self, view: CacheView) -> list[Decision]:
        scores = self.future_scores(view)
        return [d for layer in range(view.num_layers)
                for d in evict(layer, lowest_scoring(view, layer, scores[layer], excess_blocks(view, layer)))]

    def future_scores(self, view: CacheView) -> torch.Tensor:
        """``[L, N]`` each block's attention still to come; accumulated mass where nothing is known."""
        if self.trace is None:
            if not getattr(self, "_warned", False):
                warnings.warn("Oracle without a trace evicts by accumulated attention (not an oracle); build it "
                              "with Oracle.from_run(model, ids, max_new_tokens, prefill_chunk)", stacklevel=3)
                self._warned = True
            return view.acc_mass
        if self.trace.mass.shape[1] != view.num_layers:
            raise ValueError(f"Oracle: the trace has {self.trace.mass.shape[1]} layers, the cache {view.num_layers}")
        future = self.trace.future_mass(view.seen, self.horizon)
        if future is None:
            return view.acc_mass
        scores = torch.zeros(view.num_layers, view.num_blocks)
        width = min(view.num_blocks, future.shape[1])
        scores[:, :width] = future[:, :width]
        return scores
