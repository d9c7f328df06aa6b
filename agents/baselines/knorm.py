"""Knorm (Devoto et al., EMNLP 2024, arXiv 2406.11430, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"; kvpress ``KnormPress``): keys with a low L2 norm draw high attention, so keep the lowest-norm keys.

The rule (kvpress 0.5.5): a token's score is ``−‖k‖₂`` (in float32), per KV head; each KV head keeps its
highest-scoring tokens, once, at the end of the prefill. No attention is needed, and no window is protected.
The key norm is the same before and after RoPE (a rotation), so the cached post-RoPE keys give it directly.

On blocks: a token's score is ``−‖k‖₂`` averaged over the layer's KV heads, and a block's score is its best
token's (``max``): a page is worth keeping if any of its tokens is, as in Quest's page bound (a mean would dilute
one low-norm token among fifteen others). At block size 1 the ranking is kvpress's up to the KV-head average.

Decision points: the same rule at every decision (``compress`` = kvpress's press; streaming ``prefill``,
``question`` and ``decode``: the lowest-scoring device blocks are evicted until each layer fits its budget). It
never prefetches.

Deviations: blocks of 16 tokens; one block set per layer for all KV heads (kvpress selects per KV head;
per-KV-head selection is out of scope), hence the mean over KV heads. On the peer samples (25% kept) kvpress's
Knorm scores 0.400 per KV head and 0.533 per layer; this controller 0.567 at block size 1 (benchmarks/HISTORY.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.baselines.base import Tokens, evict_lowest, token_scores_per_block
from cache.controller import CacheView, Decision


def negative_key_norm(tokens: Tokens) -> torch.Tensor:
    """``[T]``: ``−‖k‖₂`` of each token, averaged over KV heads."""
    return -tokens.keys.norm(dim=-1).mean(dim=-1)


@dataclass
class Knorm:
    """No parameters: kvpress's only knob is the compression ratio, which here is the layer budget."""

    def decide(self, view: CacheView) -> list[Decision]:
        return evict_lowest(view, token_scores_per_block(view, negative_key_norm, "max"))
