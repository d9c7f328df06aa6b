"""A trained ranking policy as a cache ``Controller``: at every decision point it scores every block of every
layer (``cache.ranking.policy_features``) and keeps each layer's top-b on device (``keep_top``): it evicts,
merges, prefetches and keeps by itself, with no budget fallback left to act.

Parameters (``ranker:PATH,stay=2,question_stay=0,blind_phase=prefill,blind=PATH,blind_prefill=true``): ``merge``,
``stay`` (hysteresis), ``question_stay`` (the hysteresis at the question's decision point, where a block offloaded
during the prefill may be the one the answer needs; default: ``stay``), ``blind_phase`` (how a question-blind one-shot compression is presented, see
``CacheView.question_read``), ``blind``: a second ranker file that makes the question-blind one-shot compressions
instead (one trained for them, e.g. on KVzip's scores: `python -m benchmarks.ranker_tools train --target teacher`), and
``blind_prefill``: it also makes the question-blind decisions of a streamed prefill; every other decision stays
``PATH``'s. ``lookahead`` (tokens): at the answer's decision points the blocks rank by the attention of that many
tokens drafted ahead on the device blocks (``agents.baselines.lookahead``), the policy's scores breaking ties;
``lookahead_rounds``: drafts per such decision, each on the device set the previous one chose; ``lookahead_question``:
the question's decision point drafts too (the last token read fed again, so the draft's first token stands in for
the prompt's last one, not yet read), on every live block with ``question_draft_live`` (host blocks read where they lie,
once: host-side attention); ``question_reread``: the runner re-encodes the question over every live block
before the question's decision (``cache.copies.reread_tokens``); ``reread_attention``: the re-read's attention to every
live block also replaces the streamed question's attention statistics, which only the device blocks had.
``pyramid_beta`` > 1: the layers' budgets follow PyramidKV's linear pyramid of that steepness (the same total, most
in layer 0; ``agents.baselines.base.pyramid_split``) instead of an even split: a hand-set allocation across layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agents.baselines.base import pyramid_split
from agents.baselines.lookahead import check_reread, check_rounds, check_tokens, lookahead_scores
from agents.ranker.model import load_ranker
from cache.controller import CacheView, Decision
from cache.ranking import check_blind_phase, keep_top, policy_features, within_layer_rank

MAX_STAY = 100.0  # beyond this every resident block outranks every other: the ranking stops mattering
MAX_PYRAMID_BETA = 1000.0  # beyond this the top layers keep their pinned blocks alone at any budget


@dataclass
class RankerController:
    """The learned ranker as a cache controller (module docstring: parameters and phases)."""
    positional_parameter = "path"
    path: str = "policies/ranker_smollm2.pt"
    merge: bool = True  # false: never merge (evict whatever falls out)
    stay: float = 0.0  # hysteresis: resident blocks rank this many score std devs higher (keep_top's ``stay``)
    question_stay: float | None = None  # the hysteresis at the "question" decision point (None: ``stay``)
    # the phase a compression made before the question is read (``oneshot``) is shown to the policy as: its
    # training saw question-blind decisions only mid-prefill (streaming), and "compress" only with the question
    # read (``oneshot-question``); "compress" gives the features as recorded
    blind_phase: str = "prefill"
    blind: str = ""  # a ranker file for the question-blind one-shot compressions ("": PATH's decides them too)
    blind_prefill: bool = False  # the blind file also decides a streamed prefill's decisions (question not read)
    # > 0: at the answer's decision points, blocks rank by the attention of this many tokens drafted ahead
    # (agents.baselines.lookahead), the policy's scores breaking ties
    lookahead: int = 0
    lookahead_rounds: int = 1  # drafts per such decision, each on the device set the previous one chose
    lookahead_question: bool = False  # the question's decision point drafts too (from the last token read)
    question_draft_live: bool = False  # that draft reads every live block (host ones where they lie), not the device's
    question_reread: bool = False  # the question re-encoded over every live block before its decision (the runner)
    reread_attention: bool = False  # and its attention to every live block taken as the latest statistics
    pyramid_beta: float = 1.0  # > 1: layer budgets in PyramidKV's pyramid of this steepness (1: an even split)
    _model: object = field(default=None, init=False, repr=False)
    _blind_model: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        check_blind_phase(self.blind_phase)  # at construction, not at the first decision
        for name in ("stay", "question_stay"):
            value = getattr(self, name)
            if name == "question_stay" and value is None:
                continue
            if not 0.0 <= value <= MAX_STAY:  # also refuses NaN
                raise ValueError(f"ranker: {name}={value!r} is outside 0..{MAX_STAY:g} (score standard deviations a "
                                 "resident block is lifted by; 2 is the shipped setting)")
        check_tokens(self.lookahead, "ranker: lookahead")
        check_rounds(self.lookahead_rounds, "ranker: lookahead_rounds")
        check_reread(self.question_reread, self.reread_attention, "ranker")
        if not 1.0 <= self.pyramid_beta <= MAX_PYRAMID_BETA:  # also refuses NaN
            raise ValueError(f"ranker: pyramid_beta={self.pyramid_beta!r} is outside 1..{MAX_PYRAMID_BETA:g} (the "
                             "pyramid's steepness: the last layer keeps 1/beta of the mean budget; 1 = an even split, "
                             "20 = PyramidKV's)")
        if self.question_draft_live and not (self.lookahead and self.lookahead_question):
            raise ValueError("ranker: question_draft_live=true is how the question's draft reads the cache; it needs "
                             "lookahead=N and lookahead_question=true")
        if self.blind_prefill and not self.blind:
            raise ValueError("ranker: blind_prefill=true needs a blind file (blind=PATH) to make those decisions")
        model, self.summary = load_ranker(self.path)
        self._model = model.inference()
        self._blind_model = load_ranker(self.blind)[0].inference() if self.blind else self._model

    def layer_budgets(self, budget: list[int]) -> list[int]:
        """Each layer's share of the run's per-layer ``budget`` (the runner asks once per run)."""
        return pyramid_split(budget, self.pyramid_beta) if self.pyramid_beta > 1 else list(budget)

    def scores(self, view: CacheView) -> tuple[np.ndarray, np.ndarray]:
        """``[L, N]`` keep scores and merge logits of every block."""
        blind_phases = ("compress", "prefill") if self.blind_prefill else ("compress",)
        blind = view.phase in blind_phases and not view.question_read
        return (self._blind_model if blind else self._model)(policy_features(view, self.blind_phase))

    def decide(self, view: CacheView) -> list[Decision]:
        keep, merge = self.scores(view)
        if self.lookahead and (view.phase == "decode" or (self.lookahead_question and view.phase == "question")):
            live = self.question_draft_live and view.phase == "question"
            share = lookahead_scores(view, self.lookahead, self.lookahead_rounds, live=live).numpy()
            scaled = share / np.maximum(share.max(axis=1, keepdims=True), 1e-12)
            keep = scaled + 1e-3 * within_layer_rank(keep.astype(np.float32), view.live_blocks.numpy())
        stay = self.question_stay if view.phase == "question" and self.question_stay is not None else self.stay
        return keep_top(view, keep, merge if self.merge else None, stay=stay)
