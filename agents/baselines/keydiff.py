"""KeyDiff (Park et al., 2025, arXiv 2504.15364, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments"; kvpress ``KeyDiffPress``): keep the keys least like the
others.

The rule (kvpress 0.5.5): per KV head, the anchor is the mean of the L2-normalised keys of the layer; a token's
score is ``−cos(k, anchor)``, so distinctive keys score high; each KV head keeps its highest-scoring tokens. No
attention is needed. kvpress applies it once at the end of the prefill; the paper processes the prompt block by
block and evicts after each block with the anchor of the keys cached at that point (kvpress: ``BlockPress``).

On blocks: the anchor is the mean normalised key of the layer's device tokens, per KV head; a token's score is
``−cos(k, anchor)`` averaged over the layer's KV heads; a block's score is its best token's (``max``: a page is
worth keeping if any of its tokens is distinctive; a mean would dilute one distinctive token among fifteen
ordinary ones). At block size 1 the ranking is kvpress's up to the KV-head average.

Decision points: ``compress`` (one-shot) is kvpress's press. In the streaming protocol the rule runs after
every prefill chunk with the anchor of what is cached then, which is the paper's block-wise prefill (chunks of
the runner's ``prefill_chunk`` tokens); ``question`` and ``decode`` decisions do the same. It never prefetches.

Deviations: blocks of 16 tokens; one block set per layer for all KV heads (the paper and kvpress select per
KV head; per-KV-head selection is out of scope), hence the mean over KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agents.baselines.base import Tokens, evict_lowest, token_scores_per_block
from cache.controller import CacheView, Decision


def key_distinctiveness(tokens: Tokens) -> torch.Tensor:
    """``[T]``: ``−cos(k, anchor)`` of each token, the anchor being the mean normalised key of its KV head over
    the given tokens, averaged over KV heads."""
    anchor = F.normalize(tokens.keys, dim=-1).mean(dim=0, keepdim=True)  # [1, kv_heads, dim]
    return -F.cosine_similarity(tokens.keys, anchor, dim=-1).mean(dim=-1)


@dataclass
class KeyDiff:
    """No parameters: kvpress's only knob is the compression ratio, which here is the layer budget."""

    def decide(self, view: CacheView) -> list[Decision]:
        return evict_lowest(view, token_scores_per_block(view, key_distinctiveness, "max"))
