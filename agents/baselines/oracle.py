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
- ``prefetch=true`` (``oracle:prefetch=true``): the oracle a host tier allows. At each decision point it ranks
  every live block of every layer, resident or offloaded, by the attention of the queries up to the next
  decision point (the next ``window`` tokens while the prompt streams, one prefill chunk by default; the next
  ``decode_window`` tokens once the question is read, the harness's ``decide_every``), ties broken by the
  attention still to come after that, and keeps the top-b of each layer on the device (``keep_top``: what
  falls out is evicted, to the host when it has room; what rises in is prefetched). Without it the oracle only
  evicts, so a block sent to the host never returns: with a host tier that is a weak ceiling. ``stay`` (≥ 0,
  ``keep_top``'s hysteresis: resident blocks rank with that many standard deviations of the layer's scores added)
  trades accuracy for bytes moved: the cost-aware oracle a learned controller's bytes are measured against.
- ``prefill_ranker=PATH`` (a diagnostic, not a bound): the prefill's decision points are a ranker file's
  (``ranker:PATH,stay=2,question_stay=0``, the shipped setting), the oracle decides from the question on. Between the policy and
  the oracle it splits the gap into what the prefill left (the oracle's prefill knows which blocks the question
  will read and prefetches them before the question is encoded; no causal controller can) and what the
  question-time choice misses. ``ranker_phases`` (``prefill`` by default) names the phases the ranker decides
  (``prefill+question``: the oracle only during the answer), to split the gap further.
- Without a trace (``Oracle()``, as the registry builds it), it is not an oracle: it evicts by accumulated
  attention mass (``acc_mass``, H2O's score without a recent window) and warns once. Build the real one with
  ``Oracle.from_run(model, ids, max_new_tokens, prefill_chunk)``, or record any loop with ``TraceRecorder``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from agents.baselines.base import evict, excess_blocks, lowest_scoring
from cache.controller import CacheView, Decision
from cache.trace import AttentionTrace, TraceRecorder, record_trace  # noqa: F401  (TraceRecorder: re-exported)


@dataclass
class Oracle:
    """The future-attention oracle: keeps the blocks a full-cache trace says will be attended most (module
    docstring)."""
    # its trace is a full-cache run with the same forward passes: recorded under the streaming protocol only
    protocols = ("streaming",)
    horizon: int | None = None  # tokens of future attention summed; None: the rest of the run
    prefetch: bool = False  # rank resident and offloaded blocks by their next attention; prefetch what rises in
    window: int = 64  # prefetch: tokens ahead that count while the prompt streams (one prefill chunk)
    decode_window: int = 8  # prefetch: tokens ahead that count once the question is read (decisions' spacing)
    stay: float = 0.0  # prefetch: keep_top's hysteresis (0: the plain top-b, which moves the most bytes)
    prefill_ranker: str = ""  # a ranker file that makes the prefill's decisions ("": the oracle makes them)
    ranker_phases: str = "prefill"  # with prefill_ranker: the phases it decides ("+"-joined, e.g. prefill+question)
    trace: AttentionTrace | None = field(default=None, repr=False)
    _prefill: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not self.stay >= 0:  # also refuses NaN
            raise ValueError(f"oracle stay: expected a margin >= 0 (standard deviations of a layer's scores), got {self.stay!r}")
        phases = self.ranker_phases.split("+")
        if any(phase not in ("prefill", "question", "decode") for phase in phases):  # "" splits to [""]: refused
            raise ValueError(f"oracle ranker_phases {self.ranker_phases!r}: '+'-joined phases of prefill, question, "
                             "decode (the ones prefill_ranker decides)")
        self._ranker_phases = set(phases)
        if self.prefill_ranker:  # loaded now, so that a bad file is refused before any run
            from agents.ranker.controller import RankerController

            self._prefill = RankerController(self.prefill_ranker, stay=2.0, question_stay=0.0)

    @classmethod
    def from_run(cls, model, input_ids, max_new_tokens: int = 64, prefill_chunk: int = 64,
                 horizon: int | None = None, **kwargs) -> Oracle:
        """An oracle for runs of ``input_ids`` with this ``max_new_tokens`` and ``prefill_chunk`` (pass the
        same to the runner); ``kwargs`` go to ``record_trace`` (``tokenizer``, ``cache_config``, ...)."""
        return cls(horizon=horizon, trace=record_trace(model, input_ids, max_new_tokens, prefill_chunk, **kwargs))

    def decide(self, view: CacheView) -> list[Decision]:
        if self._prefill is not None and view.phase in self._ranker_phases:
            return self._prefill.decide(view)
        if self.prefetch:
            from cache.ranking import keep_top

            return keep_top(view, self.prefetch_scores(view).numpy(), stay=self.stay)
        scores = self.future_scores(view)
        return [d for layer in range(view.num_layers)
                for d in evict(layer, lowest_scoring(view, layer, scores[layer], excess_blocks(view, layer)))]

    def prefetch_scores(self, view: CacheView) -> torch.Tensor:
        """``[L, N]`` keep scores of the prefetching oracle: the attention of the next window's queries, each
        layer's scaled to at most 1, plus 1e-3 times the later attention (likewise scaled), so that blocks needed
        next rank first and, among the rest, those needed later stay rather than move."""
        near_window = self.window if view.phase == "prefill" else self.decode_window
        near = self._known_future(view, near_window)
        later = self._known_future(view, self.horizon)

        def scaled(mass: torch.Tensor) -> torch.Tensor:
            return mass / mass.amax(dim=1, keepdim=True).clamp(min=1e-12)

        return scaled(near) + 1e-3 * scaled(later)

    def _known_future(self, view: CacheView, horizon: int | None) -> torch.Tensor:
        """``_trace_future``, 0 past the trace's end (accumulated mass, with a warning, without a trace)."""
        if self.trace is None:
            return self.future_scores(view)
        future = self._trace_future(view, horizon)
        return torch.zeros(view.num_layers, view.num_blocks) if future is None else future

    def _trace_future(self, view: CacheView, horizon: int | None) -> torch.Tensor | None:
        """``[L, N]`` the trace's attention to each block over the next ``horizon`` tokens (None: the rest of the
        run); None past the trace's end."""
        if self.trace.mass.shape[1] != view.num_layers:
            raise ValueError(f"Oracle: the trace has {self.trace.mass.shape[1]} layers, the cache {view.num_layers}")
        future = self.trace.future_mass(view.seen, horizon)
        if future is None:
            return None
        scores = torch.zeros(view.num_layers, view.num_blocks)
        width = min(view.num_blocks, future.shape[1])
        scores[:, :width] = future[:, :width]
        return scores

    def future_scores(self, view: CacheView) -> torch.Tensor:
        """``[L, N]`` each block's attention still to come; accumulated mass where nothing is known."""
        if self.trace is None:
            if not getattr(self, "_warned", False):
                warnings.warn("Oracle without a trace evicts by accumulated attention (not an oracle); build it "
                              "with Oracle.from_run(model, ids, max_new_tokens, prefill_chunk)", stacklevel=3)
                self._warned = True
            return view.acc_mass
        future = self._trace_future(view, self.horizon)
        return view.acc_mass if future is None else future
