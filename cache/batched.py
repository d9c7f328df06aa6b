"""Several sequences, each with its own ``PagedKVCache``, advanced by one batched forward pass.

``model(input_ids=[N, q], position_ids=[N, q], cache=BatchedPagedCache(caches))``: the projections, MLPs and
logits run once for the batch (the bulk of a decode step on a small model); in each attention layer, row ``i``
writes its new keys and values into ``caches[i]`` and attends only that cache's device blocks (the paged
attention function loops over the rows, since their resident lengths differ). Rows must feed the same number
of tokens ``q`` (group a mixed batch by ``q``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from cache.paged_cache import PagedKVCache


class BatchedPagedCache(Cache):
    """Row ``i`` of a batched forward reads and writes ``caches[i]``."""

    def __init__(self, caches: list[PagedKVCache]):
        if not caches:
            raise ValueError("BatchedPagedCache: give at least one cache")
        layers = {cache.num_layers for cache in caches}
        if len(layers) != 1:
            raise ValueError(f"BatchedPagedCache: the caches have different layer counts {sorted(layers)}")
        self.caches = list(caches)
        super().__init__(layers=caches[0].layers)  # masks are sized from row 0; the paged attention ignores them

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if key_states.shape[0] != len(self.caches):
            raise ValueError(f"BatchedPagedCache: a batch of {key_states.shape[0]} rows for {len(self.caches)} caches")
        attention_kwargs = kwargs.get("kwargs")
        if not isinstance(attention_kwargs, dict):
            raise RuntimeError("BatchedPagedCache needs the model's attention kwargs (transformers' Cache.update API)")
        rows = [cache.layers[layer_idx].update(key_states[i : i + 1], value_states[i : i + 1])
                for i, cache in enumerate(self.caches)]
        attention_kwargs["paged_batch"] = (self.caches, rows)  # read by cache.attention.paged_attention_forward
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.caches[0].get_seq_length(layer_idx)

    def positions(self, q_len: int) -> torch.Tensor:
        """``[N, q_len]`` position ids of the next ``q_len`` tokens of every row."""
        starts = torch.tensor([cache.seen for cache in self.caches])
        return starts[:, None] + torch.arange(q_len)[None, :]


@torch.no_grad()
def batched_forward(model, caches: list[PagedKVCache], input_ids: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
    """One forward of ``input_ids`` ``[N, q]`` over N paged caches; returns logits ``[N, min(q, keep), vocab]``."""
    batch = BatchedPagedCache(caches)
    out = model(input_ids=input_ids, position_ids=batch.positions(input_ids.shape[1]), cache=batch, use_cache=True,
                logits_to_keep=logits_to_keep)
    return out.logits
