"""Lookahead at the answer's decision points: draft the next tokens with the cache's own device blocks, and rank
every live block by the attention those drafted tokens' queries pay it.

The future-attention oracle keeps at a decode decision the blocks the next ``decode_window`` answer tokens attend.
A causal controller cannot know them, but it can draft them: greedy decoding of ``tokens`` tokens on a copy of each
layer's device tokens (``kvzip.resident_copy``, as KVzip's reconstruction runs; the newest token fed again so that
its logits start the draft), recording each drafted token's query per layer. The drafted tokens may be wrong (the
blocks they need may be offloaded), but their queries ask for what the answer needs, which the offloaded keys
answer: ``CacheView.attention_share`` scores every live block exactly against them, offloaded ones where they lie
(host-side scoring, as RetrievalAttention scores offloaded keys). The draft and its copy are discarded.

Cost per decision: ``tokens`` forwards over the device blocks (the budget's tokens, not the context) and one
attention pass of ``tokens`` queries over the whole cache."""

from __future__ import annotations

import torch

from agents.baselines.kvzip import resident_copy
from cache.controller import CacheView


@torch.no_grad()
def draft_queries(view: CacheView, tokens: int) -> tuple[list[torch.Tensor], int]:
    """``([heads, tokens, dim] per layer, first position)``: the queries of the newest token (fed again) and of
    ``tokens - 1`` tokens greedily drafted after it on a copy of the device blocks."""
    if view.model is None or view.token_ids is None or view.seen == 0:
        raise ValueError("lookahead: the decision point carries no model or tokens to draft with")
    model = view.model
    device = next(model.parameters()).device
    copy, _ = resident_copy(view, tokens + 1, drop_newest=1)
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


def lookahead_scores(view: CacheView, tokens: int) -> torch.Tensor:
    """``[L, N]``: each live block's attention share from the drafted queries (max over query heads, mean over
    the drafted tokens); 0 for the others."""
    queries, first = draft_queries(view, tokens)
    return view.attention_share(queries, first).amax(dim=-1)
