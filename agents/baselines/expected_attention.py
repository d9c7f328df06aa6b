"""Expected Attention (Devoto, Jeblick & Jégou, 2025, arXiv 2510.00636, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution"; official code: kvpress ``ExpectedAttentionPress``, by the
same authors): keep the keys that future queries are expected to attend to.

The rule (kvpress 0.5.5): model the future queries of each head as a Gaussian: the mean ``μ`` and covariance
``Σ`` of the prompt's **pre-RoPE** queries (every prompt position but the first ``n_sink``), rotated by the
RoPE rotation averaged over the next ``n_future_positions`` positions (``R̄``: ``μ' = R̄μ``, ``Σ' = R̄ΣR̄ᵀ``).
Since ``E[exp(q·k/√d)] = exp(k·μ'/√d + kᵀΣ'k / 2d)`` for Gaussian ``q``, a key's expected attention is the
softmax over the keys of ``k·μ'/√d + kᵀΣ'k / 2d`` (the covariance term when ``use_covariance``), averaged over
the query heads of its KV group, then multiplied by ``‖v‖₂`` (plus ``epsilon``) when ``use_vnorm`` (its
expected contribution to the output). The first ``n_sink`` tokens are left out of the softmax and always
kept; each KV head keeps its highest-scoring tokens, once, at the end of the prefill.

On blocks, per layer: the same score per query head over the layer's device tokens, summed over each block's
tokens (an expected attention mass, like the other attention-based scores), then ``aggregation`` over query
heads (``"mean"``: kvpress's group mean, here over all of the layer's heads; ``"max"`` keeps a block any single
head expects to need). The blocks holding the first ``n_sink`` tokens are protected; the lowest-scoring device
blocks are evicted until the layer fits its budget.

Query statistics, by decision point (``view.phase``):

- ``compress`` (one-shot), ``query_statistics = "prompt"`` (default, kvpress): one extra forward of every token
  seen (``view.model`` on ``view.token_ids``, no cache), reading each layer's pre-RoPE queries as ``q_proj``
  writes them; it costs about one dense prefill of the prompt;
- every other decision (streaming ``prefill``, ``question``, ``decode``), or ``query_statistics = "window"``: the
  latest forward's counted queries (``view.window_queries``, the last ``stats_window`` = 64 of a prefill chunk,
  or the one query of a decode step, whose covariance is then 0), un-rotated at their positions. A forward of
  the whole prompt at every streaming decision would cost a prefill per chunk.

The future positions start at ``view.seen`` (kvpress: ``q_len``, the prefilled length).

Deviations: blocks of 16 tokens, not tokens; one block set per layer for all KV heads (kvpress selects per KV
head; per-KV-head selection is out of scope). On the peer samples (25% kept) kvpress's press scores 0.000 per KV
head and 0.633 with one token set per layer, this controller's figure at block size 1 (benchmarks/HISTORY.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agents.baselines.base import (
    AGGREGATIONS,
    check_choice,
    device_tokens,
    evict_lowest,
    over_heads,
    rope_cos_sin,
    unrotate,
)
from cache.controller import CacheView, Decision


def average_rotation(model_config, first_position: int, count: int) -> torch.Tensor:
    """``[head_dim, head_dim]``: the mean over positions ``first_position .. first_position + count − 1`` of the
    RoPE rotation ``x ↦ x·cos + rotate_half(x)·sin`` as a matrix."""
    cos, sin = rope_cos_sin(model_config, torch.arange(first_position, first_position + count))
    dim = cos.shape[-1]
    half = dim // 2
    rotate_half = torch.zeros(dim, dim)  # rotate_half(x) = [-x2, x1] as a matrix
    rotate_half[:half, half:] = -torch.eye(half)
    rotate_half[half:, :half] = torch.eye(half)
    return torch.diag(cos.mean(dim=0)) + torch.diag(sin.mean(dim=0)) @ rotate_half


def moments(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[H, d]`` and covariance ``[H, d, d]`` (divided by the count, as kvpress) of ``queries`` ``[H, T, d]``."""
    mean = queries.mean(dim=1)
    centered = queries - mean[:, None]
    return mean, centered.transpose(1, 2) @ centered / queries.shape[1]


@torch.no_grad()
def prompt_query_moments(model, token_ids: torch.Tensor, n_sink: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the moments of the pre-RoPE queries of ``token_ids`` past the first ``n_sink``, from one forward
    of ``model`` (a Llama-family causal LM) without a cache, reading each layer's ``q_proj`` output."""
    layers = model.model.layers
    found: list = [None] * len(layers)
    heads, dim = model.config.num_attention_heads, layers[0].self_attn.head_dim

    def reader(index: int):
        def read(module, inputs, output):
            queries = output[0, n_sink:].float().cpu().reshape(-1, heads, dim).transpose(0, 1)  # [H, T, d]
            found[index] = moments(queries)
        return read

    handles = [layer.self_attn.q_proj.register_forward_hook(reader(index)) for index, layer in enumerate(layers)]
    try:
        device = next(model.parameters()).device
        model.model(input_ids=token_ids.reshape(1, -1).to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return found


def window_query_moments(view: CacheView, n_sink: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per layer, the moments of the latest forward's counted queries, un-rotated at their positions (those
    before ``n_sink`` left out when others remain); None before the first forward."""
    window = view.window_queries
    if window is None:
        return None
    positions = view.window_positions
    keep = positions >= n_sink if bool((positions >= n_sink).any()) else torch.ones_like(positions, dtype=torch.bool)
    cos, sin = rope_cos_sin(view.cache.model_config, positions[keep])
    return [moments(unrotate(queries[:, keep].transpose(0, 1), cos, sin).transpose(0, 1)) for queries in window]


def expected_scores(keys: torch.Tensor, values: torch.Tensor, mean: torch.Tensor, covariance: torch.Tensor | None,
                    use_vnorm: bool, epsilon: float) -> torch.Tensor:
    """``[H, T]``: each query head's expected attention over the tokens (``keys``/``values`` ``[T, kv_heads, d]``),
    the queries being Gaussian with ``mean`` ``[H, d]`` and ``covariance`` ``[H, d, d]`` (post-rotation; None:
    mean only); scaled by ``‖v‖₂`` (+ ``epsilon``) when ``use_vnorm``. Query head ``h`` reads KV head
    ``h // group`` (``repeat_kv``)."""
    group = mean.shape[0] // keys.shape[1]
    dim = keys.shape[-1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, T, d]
    logits = torch.einsum("htd,hd->ht", k, mean) / math.sqrt(dim)
    if covariance is not None:
        logits = logits + torch.einsum("htd,hde,hte->ht", k, covariance, k) / dim / 2
    scores = torch.softmax(logits, dim=-1)
    if use_vnorm:
        scores = (scores + epsilon) * values.norm(dim=-1).repeat_interleave(group, dim=1).T
    return scores


@dataclass
class ExpectedAttention:
    """Expected Attention (kvpress): blocks scored by the attention expected from future queries (module docstring)."""
    n_future_positions: int = 512  # kvpress default
    n_sink: int = 4  # kvpress default: first tokens out of the statistics and the softmax, always kept
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    query_statistics: str = "prompt"  # at compress: "prompt" (kvpress: every prompt query) or "window"
    aggregation: str = "mean"  # over query heads: "mean" (kvpress's group mean) or "max"

    def __post_init__(self):
        check_choice("ExpectedAttention", "query_statistics", self.query_statistics, ("prompt", "window"))
        check_choice("ExpectedAttention", "aggregation", self.aggregation, AGGREGATIONS)
        if self.n_future_positions < 1 or self.n_sink < 0:
            raise ValueError(f"ExpectedAttention: n_future_positions must be >= 1 and n_sink >= 0, got "
                             f"{self.n_future_positions}, {self.n_sink}")

    def query_moments(self, view: CacheView) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer, the pre-RoPE query mean and covariance this decision uses (see the module docstring)."""
        if (view.phase == "compress" and self.query_statistics == "prompt" and view.model is not None
                and view.token_ids is not None and view.token_ids.numel() > self.n_sink):
            return prompt_query_moments(view.model, view.token_ids, self.n_sink)
        return window_query_moments(view, self.n_sink)

    def block_scores(self, view: CacheView) -> torch.Tensor:
        """``[L, N]`` expected attention mass of every device block (0 before the first forward)."""
        found = self.query_moments(view)
        if found is None:
            return torch.zeros(view.num_layers, view.num_blocks)
        rotation = average_rotation(view.cache.model_config, view.seen, self.n_future_positions)
        per_layer = []
        for layer, (mean, covariance) in enumerate(found):
            tokens = device_tokens(view, layer)
            scored = tokens.position >= self.n_sink
            scores = expected_scores(tokens.keys[scored], tokens.values[scored], mean @ rotation.T,
                                     rotation @ covariance @ rotation.T if self.use_covariance else None,
                                     self.use_vnorm, self.epsilon)  # [H, T']
            per_layer.append(torch.zeros(scores.shape[0], view.num_blocks).index_add_(1, tokens.block[scored], scores))
        return over_heads(torch.stack(per_layer), self.aggregation)

    def decide(self, view: CacheView) -> list[Decision]:
        return evict_lowest(view, self.block_scores(view), protect=view.first_position < self.n_sink)
