"""Per-block statistics, updated as a side effect of writing keys and of attention.

All tensors are indexed ``[layer, logical_block]`` (per-head ones ``[layer, query_head, logical_block]``).
The head-averaged masses hand out a total of 1 per query over the blocks it sees; per-head masses are kept
too, so a controller can take the max over query heads (retrieval heads drown in a mean) or aggregate each
KV group itself.
"""

from __future__ import annotations

import torch


class BlockStats:
    """Statistics of every (layer, logical block).

    - ``acc_mass``: attention mass received, summed over every query that saw the block (H2O's score);
    - ``last_mass``: the mass of the latest forward pass alone (its last ``stats_window`` queries in a
      prefill chunk: SnapKV's observation window; the current query in a decode step: TOVA's score);
    - ``recent_mass``: the same, exponentially decayed by ``recent_decay`` per forward pass;
    - ``acc_mass_heads`` / ``last_mass_heads`` ``[L, heads, N]``: the same two per query head (not averaged);
    - ``last_query_heads`` ``[L, heads, N]``: the attention of the latest forward's *last* query alone (the
      end of the prompt after a prefill, the current token in a decode step: TOVA's score);
    - ``observers``: for each block, the number of counted queries that could see each of its tokens, summed
      over its tokens and over forwards; ``acc_mass / (observers / num_tokens)`` is H2O's score normalised by
      how many queries could attend the block (kvpress's ObservedAttention);
    - ``query_max_heads`` ``[L, heads, N]`` (only with ``track_query_max``): the largest mass any single
      counted query gave the block, per head (KVzip's max over its reconstruction queries);
    - ``last_attended``: logical length of the sequence (tokens seen) when the block last received at least
      ``attended_share`` × the uniform share (1 / resident blocks) of a forward pass's attention; -1 if never;
    - ``key_sum``/``key_min``/``key_max``: sum and per-channel min/max of the block's post-RoPE keys,
      ``[L, N, kv_heads, head_dim]``; ``mean_key()`` divides by the token count. They are computed from
      the pool when a block fills up (and per prefill chunk), so each layer's newest block may lag until
      ``PagedKVCache.refresh_key_stats()`` runs (``CacheView`` does it).
    """

    def __init__(self, num_layers: int, max_blocks: int, recent_decay: float = 0.9, attended_share: float = 1.0,
                 track_query_max: bool = False):
        if not 0.0 <= recent_decay < 1.0:
            raise ValueError(f"recent_decay must be in [0, 1), got {recent_decay}")
        self.num_layers = num_layers
        self.max_blocks = max_blocks
        self.recent_decay = recent_decay
        self.attended_share = attended_share
        self.acc_mass = torch.zeros(num_layers, max_blocks)
        self.recent_mass = torch.zeros(num_layers, max_blocks)
        self.last_attended = torch.full((num_layers, max_blocks), -1, dtype=torch.int64)
        self.last_mass = torch.zeros(num_layers, max_blocks)
        self.observers = torch.zeros(num_layers, max_blocks)
        self.track_query_max = track_query_max
        # per-head tensors are created on the first forward, when the number of query heads is known
        self.acc_mass_heads: torch.Tensor | None = None
        self.last_mass_heads: torch.Tensor | None = None
        self.last_query_heads: torch.Tensor | None = None
        self.query_max_heads: torch.Tensor | None = None
        self.key_sum: torch.Tensor | None = None
        self.key_min: torch.Tensor | None = None
        self.key_max: torch.Tensor | None = None

    def _init_keys(self, kv_heads: int, head_dim: int) -> None:
        shape = (self.num_layers, self.max_blocks, kv_heads, head_dim)
        self.key_sum = torch.zeros(shape)
        self.key_min = torch.full(shape, float("inf"))
        self.key_max = torch.full(shape, float("-inf"))

    def summarize_keys(self, layer: int, blocks: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Set the key summaries of ``blocks`` from their keys ``[nb, block_size, kv_heads, head_dim]``, of
        which the first ``counts[i]`` tokens are valid."""
        if self.key_sum is None:
            self._init_keys(keys.shape[2], keys.shape[3])
        keys = keys.detach().to(device="cpu", dtype=torch.float32)
        sums, mins, maxs = keys.sum(dim=1), keys.amin(dim=1), keys.amax(dim=1)
        for i in torch.nonzero(counts < keys.shape[1]).flatten().tolist():  # partial: at most the newest block
            valid = keys[i, : int(counts[i])]
            sums[i], mins[i], maxs[i] = valid.sum(dim=0), valid.amin(dim=0), valid.amax(dim=0)
        self.key_sum[layer, blocks] = sums
        self.key_min[layer, blocks] = mins
        self.key_max[layer, blocks] = maxs

    def record_attention(self, head_mass: torch.Tensor, num_queries: int, resident_blocks: torch.Tensor,
                         seen: int, last_query: torch.Tensor | None = None, observers: torch.Tensor | None = None,
                         query_max: torch.Tensor | None = None) -> None:
        """Add one forward pass's attention mass per head ``[L, heads, max_blocks]`` (summed over its
        ``num_queries``); ``resident_blocks`` ``[L]`` is each layer's number of device blocks. ``last_query``
        ``[L, heads, max_blocks]`` is the mass of the forward's last query alone, ``observers`` ``[L, max_blocks]``
        the counted queries that could see each block (summed over its tokens), ``query_max`` the largest
        single-query mass per head."""
        heads = head_mass.shape[1]
        if self.acc_mass_heads is None or self.acc_mass_heads.shape[1] != heads:
            shape = (self.num_layers, heads, self.max_blocks)
            self.acc_mass_heads, self.last_mass_heads = torch.zeros(shape), torch.zeros(shape)
            self.last_query_heads = torch.zeros(shape)
            self.query_max_heads = torch.zeros(shape) if self.track_query_max else None
        block_mass = head_mass.mean(dim=1)
        self.acc_mass_heads += head_mass
        self.last_mass_heads.copy_(head_mass)
        self.last_query_heads.copy_(head_mass if last_query is None else last_query)
        if observers is not None:
            self.observers += observers
        if query_max is not None and self.query_max_heads is not None:
            torch.maximum(self.query_max_heads, query_max, out=self.query_max_heads)
        self.acc_mass += block_mass
        self.last_mass.copy_(block_mass)
        self.recent_mass.mul_(self.recent_decay).add_(block_mass)
        threshold = (self.attended_share * num_queries / resident_blocks.clamp(min=1))[:, None]
        self.last_attended.masked_fill_(block_mass >= threshold, seen)

    def mean_key(self, num_tokens: torch.Tensor) -> torch.Tensor | None:
        """``[L, N, kv_heads, head_dim]`` mean post-RoPE key per block (zero for empty blocks)."""
        if self.key_sum is None:
            return None
        return self.key_sum / num_tokens.clamp(min=1)[..., None, None].to(torch.float32)

    def reset(self) -> None:
        self.acc_mass.zero_()
        self.recent_mass.zero_()
        self.last_mass.zero_()
        self.last_attended.fill_(-1)
        self.observers.zero_()
        for tensor in (self.acc_mass_heads, self.last_mass_heads, self.last_query_heads, self.query_max_heads):
            if tensor is not None:
                tensor.zero_()
        if self.key_sum is not None:
            self.key_sum.zero_()
            self.key_min.fill_(float("inf"))
            self.key_max.fill_(float("-inf"))
