"""Full-cache attention traces: what every forward pass of a run gave every block.

``TraceRecorder`` is a controller that records ``view.last_mass`` after every forward pass and evicts nothing;
``record_trace`` runs it with the runner over a prompt and its greedy continuation; ``AttentionTrace`` holds the
result and answers "how much attention does each block still get after this point" (``future_mass``). The oracle
baseline (``agents.baselines.oracle``) is built on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

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
