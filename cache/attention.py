"""kvgym's registered attention function: reads device blocks only and updates block statistics.

``PagedKVCache.update`` puts itself into the attention kwargs (``paged_cache``), so this function knows
which cache it serves. Without a paged cache (e.g. a ``DynamicCache`` reference run on the same model) it
is plain SDPA.

- Decode (one query): attention is computed explicitly (``softmax(q·Kᵀ·s)·V`` per KV-head group), so the
  attention probabilities used for the statistics come for free.
- Multi-token forwards (prefill chunks): SDPA computes the output with a causal mask built from the
  layer's own resident length (layers may hold different blocks, so the model-wide mask does not fit
  them all); statistics come from the last ``stats_window`` queries.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PAGED_ATTENTION = "kvgym_paged"


def register_paged_attention() -> None:
    """Register the attention function and its mask under ``PAGED_ATTENTION`` (idempotent)."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)


def _grouped_probs(query: torch.Tensor, key: torch.Tensor, scaling: float, allowed: torch.Tensor | None,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """Attention probabilities ``[kv_heads, group * q, kv]`` (fp32) of ``query`` ``[1, heads, q, dim]``;
    ``bias`` ``[kv_heads, kv]`` (merged slots' log weights) is added to the scores."""
    _, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query[0].reshape(kv_heads, (heads // kv_heads) * q_len, dim) * scaling
    scores = torch.matmul(grouped, key[0].transpose(-1, -2))
    if scores.dtype != torch.float32:
        scores = scores.float()
    if bias is not None:
        scores = scores + bias[:, None, :]
    if allowed is not None:  # [q, kv] bool, same for every head
        hidden = ~allowed
        hidden_columns = hidden.any(dim=0)
        # only the columns some query may not see need the fill (a causal window: its last q columns)
        first = int(hidden_columns.int().argmax()) if bool(hidden_columns.any()) else hidden.shape[1]
        scores[..., first:].masked_fill_(hidden[:, first:].repeat(heads // kv_heads, 1), float("-inf"))
    return torch.softmax(scores, dim=-1)


def causal_mask(q_len: int, kv_len: int, device, last_rows: int | None = None) -> torch.Tensor:
    """``[q, kv]`` bool (or its ``last_rows`` last rows): the q new tokens are the last q keys; each sees
    every earlier key and itself."""
    rows = q_len if last_rows is None else last_rows
    first_visible_end = kv_len - rows  # the first of the returned rows sees keys 0..kv_len-rows
    return torch.arange(kv_len, device=device)[None, :] <= first_visible_end + torch.arange(rows, device=device)[:, None]


def paged_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, paged_cache=None, paged_batch=None, **kwargs):
    """Attention over the paged cache's device blocks, recording block statistics (module docstring)."""
    if paged_batch is not None:  # a BatchedPagedCache forward: row i attends its own cache
        caches, rows = paged_batch
        outputs = [paged_attention_forward(module, query[i : i + 1], k, v, None, dropout, scaling, paged_cache=cache)[0]
                   for i, (cache, (k, v)) in enumerate(zip(caches, rows, strict=True))]
        return torch.cat(outputs, dim=0), None
    if paged_cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = module.layer_idx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    _, heads, q_len, dim = query.shape
    kv_len = key.shape[2]
    bias = paged_cache.layers[layer].attention_bias()
    if q_len == 1:
        probs = _grouped_probs(query, key, scaling, None, bias)
        output = torch.matmul(probs if probs.dtype == value.dtype else probs.to(value.dtype), value[0])
        output = output.reshape(1, 1, heads, dim)  # [kv_heads, group, dim] -> [batch, q, heads, dim]
        stats_probs, num_queries, allowed = probs, 1, None
    else:
        mask = None if kv_len == q_len else causal_mask(q_len, kv_len, query.device)[None, None]
        if bias is not None:  # merged slots: an additive float mask carries their log weights
            group = heads // key.shape[1]
            mask = torch.zeros(q_len, kv_len, device=query.device).masked_fill(
                ~causal_mask(q_len, kv_len, query.device), float("-inf"))
            mask = (mask[None, None] + bias.repeat_interleave(group, dim=0)[None, :, None, :]).to(query.dtype)
        output, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)
        window = min(q_len, paged_cache.config.stats_window)
        allowed = causal_mask(q_len, kv_len, query.device, last_rows=window)
        stats_probs = _grouped_probs(query[:, :, -window:], key, scaling, allowed, bias)
        num_queries = window
    paged_cache.record_query(layer, query[0, :, -num_queries:])
    # [kv_heads, group * q, kv] -> [heads, q, kv]: query head h = kv_head * group + g (transformers' GQA order)
    per_query = stats_probs.reshape(heads, num_queries, kv_len)
    observers = None if allowed is None else allowed.sum(dim=0).float()  # queries that see each key
    paged_cache.record_attention(layer, per_query.sum(dim=1), num_queries, last_query=per_query[:, -1].clone(),
                                 observers=observers, per_query=per_query)
    return output, None
