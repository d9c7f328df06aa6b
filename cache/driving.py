"""Driving a run: a ``Runner.steps`` generator yields a ``Forward`` for each forward pass it needs (and, with the
controller ``EXTERNAL``, a ``Decide`` at each decision point); a driver answers them. ``drive`` runs one run, a
forward at a time; ``run_batched`` and ``serve_forwards`` advance several runs together, those that feed the same
number of tokens to the same model in one batched forward (``cache.batched``: each row reads and writes its own
cache), which is how ``kvgym eval --batch-runs`` and ``KVCacheVectorEnv`` share the model between runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cache.controller import CacheView
from cache.paged_cache import PagedKVCache


class Forward(NamedTuple):
    """A run's request for one forward of ``ids`` on its ``cache``; the driver answers the last position's logits."""
    model: object
    cache: PagedKVCache
    ids: list[int]


class Decide(NamedTuple):
    """A run's request for a decision (controller ``EXTERNAL``); the driver answers ``Decision``s or a ``Placement``."""
    view: CacheView


class _External:
    """The controller whose decisions come from the run's driver (``Decide`` requests), e.g. a gymnasium env."""

    def __repr__(self) -> str:
        return "EXTERNAL"


EXTERNAL = _External()


def _no_decider(*_):
    raise RuntimeError("a run with the EXTERNAL controller asks its driver for decisions: drive it with a decide "
                       "function (drive(steps, decide), run_batched(runs, decide)) or from a gymnasium env")


def forward_one(model, cache: PagedKVCache, ids: list[int]) -> torch.Tensor:
    """One sequence's forward of ``ids`` on its cache: the last position's logits (float32)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def drive(steps, decide=None):
    """Run one generator of forwards (``Runner.steps``, ``Runner._forward``), a forward at a time; its return
    value. ``decide(view)`` answers its ``Decide`` requests (controller ``EXTERNAL``). ``run_batched`` with one run."""
    return run_batched([steps], None if decide is None else lambda _, view: decide(view))[0]


class Finished(NamedTuple):
    """What ``send_to`` gives for a run that has ended: its return value (a ``RunResult``)."""
    result: object


def send_to(steps, value, index=None):
    """``value`` sent into a run's generator (None: its start): its next request, or ``Finished``. An error the run
    raises carries ``index`` as ``run_index``."""
    try:
        with torch.no_grad():  # the run's own work between requests (decisions: KVzip's forwards) needs no graph
            return steps.send(value)
    except StopIteration as stop:
        return Finished(stop.value)
    except Exception as error:
        error.run_index = index  # which run failed (the harness names its controller)
        raise


def serve_forwards(requests: dict, send) -> dict:
    """Answer every ``Forward`` among ``requests`` (key -> a run's pending request): those of the same model and length
    in one batched forward (``cache.batched``: each row reads and writes its own cache), a lone one alone; each run
    gets its logits through ``send(key, logits)``, which returns its next request. Repeats until no forward is left
    and returns the other requests (``Decide``s, ``Finished``)."""
    from cache.batched import batched_forward

    requests = dict(requests)
    with torch.no_grad():
        while True:
            groups: dict[tuple, list] = {}
            for key, request in requests.items():
                if isinstance(request, Forward):
                    groups.setdefault((id(request.model), len(request.ids)), []).append(key)
            if not groups:
                return requests
            for members in groups.values():
                first = requests[members[0]]
                if len(members) == 1:
                    answers = {members[0]: forward_one(*first)}
                else:
                    device = next(first.model.parameters()).device
                    ids = torch.tensor([requests[key].ids for key in members], device=device)
                    logits = batched_forward(first.model, [requests[key].cache for key in members], ids)
                    answers = {key: logits[row, -1].float() for row, key in enumerate(members)}
                for key, value in answers.items():
                    requests[key] = send(key, value)


def run_batched(runs: list, decide=None) -> list:
    """Drive several runs' generators (``Runner.steps``) together: at each round every run that waits for a forward
    is served, those that feed the same number of tokens to the same model in one batched forward
    (``serve_forwards``). Returns each run's ``RunResult`` in order. The results equal those of ``drive``-ing each
    run alone up to float rounding (the batched matrix products sum in another order); the per-run times
    (``prefill_s``, ``ttft_s``, ``decode_ms_per_token``) are those of the shared forwards. A run that raises stops
    the batch; the error carries the run's position as ``run_index``. ``decide(index, view)`` answers the
    ``Decide`` requests of runs with the controller ``EXTERNAL``."""
    decide = decide or _no_decider
    results: list = [None] * len(runs)

    def send(index, value):
        return send_to(runs[index], value, index)

    requests = {index: send(index, None) for index in range(len(runs))}
    with torch.no_grad():
        while requests:
            requests = serve_forwards(requests, send)
            for index, request in list(requests.items()):
                if isinstance(request, Finished):
                    results[index] = request.result
                    del requests[index]
                else:
                    requests[index] = send(index, decide(index, request.view))
    return results
