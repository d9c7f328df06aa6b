"""Memory tiers and the physical block pool each tier keeps per layer."""

from __future__ import annotations

from enum import IntEnum

import torch

from cache.allocator import BlockAllocator


class Tier(IntEnum):
    """Where a logical block's keys and values live. Only ``DEVICE`` blocks are attended.

    ``DROPPED`` is not a tier: the block's content is gone (a cache miss if it is ever needed again).
    ``UNUSED`` marks table entries past the sequence's end.
    """

    DEVICE = 0
    HOST = 1
    DISK = 2
    DROPPED = 3
    UNUSED = -1


class TierPool:
    """The physical K and V storage of one tier for one layer, allocated once, and its allocator.

    Shapes: ``keys`` and ``values`` are ``[num_blocks, block_size, kv_heads, head_dim]``.
    """

    def __init__(self, tier: Tier, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.tier = tier
        self.block_size = block_size
        shape = (num_blocks, block_size, kv_heads, head_dim)
        pin = tier == Tier.HOST and torch.cuda.is_available() and str(device).startswith("cpu")
        self.keys = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
        self.values = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block's keys plus values."""
        return 2 * self.keys[0].numel() * self.keys.element_size()

    def flat_keys(self) -> torch.Tensor:
        """``[num_blocks * block_size, kv_heads, head_dim]`` view: one row per token slot."""
        return self.keys.view(-1, *self.keys.shape[2:])

    def flat_values(self) -> torch.Tensor:
        return self.values.view(-1, *self.values.shape[2:])
