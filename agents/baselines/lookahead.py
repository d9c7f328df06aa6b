"""Lookahead at the answer's decision points: draft the next tokens with the cache's own device blocks, and rank
every live block by the attention those drafted tokens' queries pay it (``lookahead_scores``). The ranker uses it
(``ranker:PATH,lookahead=8``); ``lookahead:BASE`` puts it behind any baseline, so that what the draft adds and what
the policy adds are measured apart.

The future-attention oracle keeps at a decode decision the blocks the next ``decode_window`` answer tokens attend.
A causal controller cannot know them, but it can draft them: greedy decoding of ``tokens`` tokens on a copy of each
layer's device tokens (``cache.copies.resident_copy``, as KVzip's reconstruction runs; the newest token fed again so that
its logits start the draft), recording each drafted token's query per layer. The drafted tokens may be wrong (the
blocks they need may be offloaded), but their queries ask for what the answer needs, which the offloaded keys
answer: ``CacheView.attention_share`` scores every live block exactly against them, offloaded ones where they lie
(host-side scoring, as RetrievalAttention scores offloaded keys). The draft and its copy are discarded.

Cost per decision: ``tokens`` forwards over the device blocks (the budget's tokens, not the context) and one
attention pass of ``tokens`` queries over the whole cache.

``rounds`` > 1 drafts again on the device set the previous draft's scores choose, read where its blocks lie (a draft
that could not read the needle asks for it; the next one reads it and drafts the answer itself).

``Lookahead`` (``lookahead:BASE,tokens=8,stay=0,rounds=1``): the baseline ``BASE`` (by name, its default parameters) makes
every decision but the answer's; at the answer's decision points (phase ``decode``) each layer keeps its pinned
blocks and the blocks the draft attends most (``keep_top``, with hysteresis ``stay``), prefetching from the host.
``question_reread=true``: the runner re-encodes the question over every live block before the question's decision
(``cache.copies.reread_tokens``), as for ``ranker:...,question_reread=true``; ``reread_attention=true``: its attention
to every live block also becomes the latest statistics (the base's question decision reads them);
``question_draft_live=true``: the question's decision is the draft's too, drafted on every live block (offloaded ones
read where they lie: ``lookahead_scores(live=True)``), as for ``ranker:...,question_draft_live=true``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cache.controller import CacheView, Decision
from cache.copies import count_host_reads, resident_copy
from cache.ranking import keep_top

MAX_TOKENS = 64
MAX_ROUNDS = 4
NOT_A_BASE = ("lookahead", "oracle", "full")  # a base must decide causally, and decide at all


@torch.no_grad()
def draft_queries(view: CacheView, tokens: int, chosen: torch.Tensor | None = None) -> tuple[list[torch.Tensor], int]:
    """``([heads, tokens, dim] per layer, first position)``: the queries of the newest token (fed again) and of
    ``tokens - 1`` tokens greedily drafted after it on a copy of the device blocks (``chosen``, ``[L, N]`` bool:
    of these blocks instead, those off the device read where they lie and counted in ``bytes_moved`` as
    ``host->host-attention``)."""
    if view.model is None or view.token_ids is None or view.seen == 0:
        raise ValueError("lookahead: the decision point carries no model or tokens to draft with")
    model = view.model
    device = next(model.parameters()).device
    copy, _ = resident_copy(view, tokens + 1, drop_newest=1, chosen=chosen)
    if chosen is not None:  # the chosen blocks off the device are read where they lie, once (host-side attention)
        count_host_reads(view, chosen)
    token, position = int(view.token_ids.flatten()[-1]), view.seen - 1
    queries: list[list[torch.Tensor]] = [[] for _ in range(view.num_layers)]
    for _ in range(tokens):
        out = model(input_ids=torch.tensor([[token]], device=device), cache=copy, use_cache=True,
                    position_ids=torch.tensor([[position]], device=device), logits_to_keep=1)
        for layer in range(view.num_layers):
            queries[layer].append(copy.last_query[layer].float().cpu())
        token, position = int(out.logits[0, -1].argmax()), position + 1
    copy.close()
    return [torch.stack(by_layer, dim=1) for by_layer in queries], view.seen - 1


def lookahead_scores(view: CacheView, tokens: int, rounds: int = 1, live: bool = False) -> torch.Tensor:
    """``[L, N]``: each live block's attention share from the drafted queries (max over query heads, mean over
    the drafted tokens); 0 for the others. Each round after the first drafts again on the device set the previous
    round's scores choose (the blocks a draft on the device blocks alone could not read, fetched for the next).
    ``live``: the first round drafts on every live block (offloaded ones read where they lie), not the device's."""
    share = None
    for _ in range(rounds):
        if share is None:
            chosen = view.live_blocks if live else None
        else:
            chosen = torch.from_numpy(keep_top(view, share.numpy()).device)
        queries, first = draft_queries(view, tokens, chosen)
        share = view.attention_share(queries, first).amax(dim=-1)
    return share


def _check_integer(value, name: str, low: int, high: int, meaning: str) -> None:
    """Refuse ``value`` unless it is an integer ``low..high`` (``name``: how the caller calls it)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r}: an integer {low}..{high} ({meaning})")


def check_tokens(tokens, name: str) -> None:
    """Refuse a draft length that is not an integer 0..MAX_TOKENS."""
    _check_integer(tokens, name, 0, MAX_TOKENS, "tokens drafted ahead at the answer's decision points; 0: none")


def check_rounds(rounds, name: str) -> None:
    """Refuse a number of draft rounds that is not an integer 1..MAX_ROUNDS."""
    _check_integer(rounds, name, 1, MAX_ROUNDS, "drafts per decision, each on the device set the previous one chose")


def check_reread(question_reread: bool, reread_attention: bool, name: str) -> None:
    """Refuse ``reread_attention`` without the re-read it takes its attention from."""
    if reread_attention and not question_reread:
        raise ValueError(f"{name}: reread_attention=true takes the attention of the question's re-read; it needs "
                         "question_reread=true")


@dataclass
class Lookahead:
    """A baseline with the draft's ranking at the answer's decision points (module docstring)."""
    positional_parameter = "base"
    base: str = "snapkv"
    tokens: int = 8
    stay: float = 0.0
    rounds: int = 1
    question_reread: bool = False  # the question re-encoded over every live block before its decision (the runner)
    reread_attention: bool = False  # and its attention to every live block taken as the latest statistics
    question_draft_live: bool = False  # the question's decision too: a draft on every live block (module docstring)
    _base: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        from agents.registry import BASELINES, make_controller

        if self.base not in BASELINES or self.base in NOT_A_BASE:
            bases = ", ".join(name for name in BASELINES if name not in NOT_A_BASE)
            raise ValueError(f"lookahead: base {self.base!r}: one of {bases}")
        check_tokens(self.tokens, "lookahead tokens")
        if self.tokens == 0:
            raise ValueError("lookahead tokens=0: nothing to draft (use the base itself)")
        check_rounds(self.rounds, "lookahead rounds")
        check_reread(self.question_reread, self.reread_attention, "lookahead")
        if not self.stay >= 0:  # also refuses NaN
            raise ValueError(f"lookahead stay: expected a margin >= 0 (standard deviations of a layer's scores), got {self.stay!r}")
        self._base = make_controller(self.base)
        for name in ("protocols", "budget_scope", "track_query_max", "layer_budgets", "fallback_rule"):  # the runner reads these
            if hasattr(self._base, name):
                setattr(self, name, getattr(self._base, name))

    def decide(self, view: CacheView) -> list[Decision]:
        live = self.question_draft_live and view.phase == "question"
        if view.phase != "decode" and not live:
            return self._base.decide(view)
        return keep_top(view, lookahead_scores(view, self.tokens, self.rounds, live=live).numpy(), stay=self.stay)
