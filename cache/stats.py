"""Per-block statistics, updated as a side effect of writing keys and of attention.

All tensors are indexed ``[layer, logical_block]``. Attention mass is averaged over query heads, so each
query hands out a total mass of 1 over the blocks it sees (GQA heads are group-averaged).
"""

from __future__ import annotations

import torch


class BlockStats:
    """Statistics of every (layer, logical block).

    - ``acc_mass``: attention mass received, summed over every query that saw the block (H2O's score);
    - ``recent_mass``: the same, exponentially decayed by ``recent_decay`` per attention call;
    - ``last_attended``: logical length of the sequence (tokens seen) when the block last received at least
      ``attended_share`` × the uniform share (1 / resident blocks) of a call's attention; -1 if never;
    - ``key_sum``/``key_min``/``key_max``: sum and per-channel min/max of the block's post-RoPE keys,
      ``[L, N, kv_heads, head_dim]``; ``mean_key()`` divides by the token count.
    """

    def __init__(self, num_layers: int, max_blocks: int, recent_decay: float = 0.9, attended_share: float = 1.0):
        if not 0.0 <= recent_decay < 1.0:
            raise ValueError(f"recent_decay must be in [0, 1), got {recent_decay}")
        self.num_layers = num_layers
        self.max_blocks = max_blocks
        self.recent_decay = recent_decay
        self.attended_share = attended_share
        self.acc_mass = torch.zeros(num_layers, max_blocks)
        self.recent_mass = torch.zeros(num_layers, max_blocks)
        self.last_attended = torch.full((num_layers, max_blocks), -1, dtype=torch.int64)
        self.key_sum: torch.Tensor | None = None
        self.key_min: torch.Tensor | None = None
        self.key_max: torch.Tensor | None = None

    def _init_keys(self, kv_heads: int, head_dim: int) -> None:
        shape = (self.num_layers, self.max_blocks, kv_heads, head_dim)
        self.key_sum = torch.zeros(shape)
        self.key_min = torch.full(shape, float("inf"))
        self.key_max = torch.full(shape, float("-inf"))

    def record_keys(self, layer: int, logical_blocks: torch.Tensor, keys: torch.Tensor) -> None:
        """Fold new keys ``[n, kv_heads, head_dim]`` into their blocks' summaries."""
        if self.key_sum is None:
            self._init_keys(keys.shape[1], keys.shape[2])
        keys = keys.detach().to(device="cpu", dtype=torch.float32)
        self.key_sum[layer].index_add_(0, logical_blocks, keys)
        index = logical_blocks[:, None, None].expand_as(keys)
        self.key_min[layer].scatter_reduce_(0, index, keys, "amin")
        self.key_max[layer].scatter_reduce_(0, index, keys, "amax")

    def record_attention(self, layer: int, block_mass: torch.Tensor, num_queries: int,
                         num_resident_blocks: int, seen: int) -> None:
        """Add one attention call's mass per logical block (``[max_blocks]``, summed over ``num_queries``)."""
        self.acc_mass[layer] += block_mass
        recent = self.recent_mass[layer]
        recent.mul_(self.recent_decay).add_(block_mass)
        threshold = self.attended_share * num_queries / max(num_resident_blocks, 1)
        self.last_attended[layer].masked_fill_(block_mass >= threshold, seen)

    def mean_key(self, num_tokens: torch.Tensor) -> torch.Tensor | None:
        """``[L, N, kv_heads, head_dim]`` mean post-RoPE key per block (zero for empty blocks)."""
        if self.key_sum is None:
            return None
        return self.key_sum / num_tokens.clamp(min=1)[..., None, None].to(torch.float32)

    def reset(self) -> None:
        self.acc_mass.zero_()
        self.recent_mass.zero_()
        self.last_attended.fill_(-1)
        if self.key_sum is not None:
            self.key_sum.zero_()
            self.key_min.fill_(float("inf"))
            self.key_max.fill_(float("-inf"))
