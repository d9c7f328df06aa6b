"""Per-layer block tables, held as tensors of metadata (one row per layer, one column per logical block).

Logical block ``b`` always covers token positions ``[b * block_size, (b + 1) * block_size)``: tokens are
appended in order and never renumbered, so a block keeps its true positions wherever its content goes.
Layers have their own rows because they may keep different blocks on the device.
"""

from __future__ import annotations

import torch

from cache.allocator import BlockAllocator, OutOfBlocksError
from cache.tiers import Tier


class BlockTables:
    """Logical → physical mapping for every layer.

    Tensors (``L`` layers, ``N`` = ``max_blocks`` logical blocks):

    - ``tier``: int8 ``[L, N]``, a ``Tier`` value (``UNUSED`` past the end);
    - ``physical``: int64 ``[L, N]``, the block id inside that tier's pool (-1 when dropped/unused);
    - ``num_tokens``: int32 ``[L, N]``, tokens written into the block.

    ``seen[layer]`` is the number of tokens appended to the layer (the logical length).
    """

    def __init__(self, num_layers: int, max_blocks: int, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_layers = num_layers
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.tier = torch.full((num_layers, max_blocks), int(Tier.UNUSED), dtype=torch.int8)
        self.physical = torch.full((num_layers, max_blocks), -1, dtype=torch.int64)
        self.num_tokens = torch.zeros((num_layers, max_blocks), dtype=torch.int32)
        self.seen = [0] * num_layers

    def num_logical(self, layer: int) -> int:
        """Logical blocks in use by ``layer`` (including dropped ones)."""
        return -(-self.seen[layer] // self.block_size)

    def first_position(self, layer: int) -> torch.Tensor:
        """First token position of each logical block in use: ``[num_logical]``."""
        return torch.arange(self.num_logical(layer), dtype=torch.int64) * self.block_size

    def append(self, layer: int, num_new: int, allocator: BlockAllocator) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for ``num_new`` tokens at the end of ``layer``, allocating device blocks as needed.

        Returns ``(slots, logical_blocks)``: each new token's flat slot in the device pool
        (``physical * block_size + offset``) and its logical block id, both int64 ``[num_new]``.
        """
        if num_new <= 0:
            raise ValueError(f"num_new must be positive, got {num_new}")
        bs = self.block_size
        start = self.seen[layer]
        end = start + num_new
        last_block = (end - 1) // bs
        if last_block >= self.max_blocks:
            raise ValueError(
                f"layer {layer}: {end} tokens exceed the table's capacity of {self.max_blocks * bs} tokens"
            )
        first_new_block = self.num_logical(layer)
        if start % bs and self.tier[layer, start // bs] != Tier.DEVICE:
            raise RuntimeError(f"layer {layer}: the partially filled newest block {start // bs} is not on the device")
        needed = last_block + 1 - first_new_block
        if needed > allocator.num_free:
            raise OutOfBlocksError(
                f"layer {layer}: {num_new} new tokens need {needed} free blocks, the device pool has "
                f"{allocator.num_free}; raise CacheConfig.device_blocks or lower the budget"
            )
        for block in range(first_new_block, last_block + 1):
            self.physical[layer, block] = allocator.allocate()
            self.tier[layer, block] = Tier.DEVICE
        positions = torch.arange(start, end, dtype=torch.int64)
        logical = positions // bs
        slots = self.physical[layer, logical] * bs + positions % bs
        counts = torch.bincount(logical - logical[0], minlength=int(logical[-1] - logical[0]) + 1)
        self.num_tokens[layer, int(logical[0]) : last_block + 1] += counts.to(torch.int32)
        self.seen[layer] = end
        return slots, logical

    def blocks_in(self, layer: int, tier: Tier) -> torch.Tensor:
        """Logical ids of ``layer``'s blocks in ``tier``, ascending (int64)."""
        n = self.num_logical(layer)
        return torch.nonzero(self.tier[layer, :n] == tier).flatten()

    def count_in(self, layer: int, tier: Tier) -> int:
        n = self.num_logical(layer)
        return int((self.tier[layer, :n] == tier).sum())

    def resident_tokens(self, layer: int) -> int:
        """Tokens of ``layer`` on the device, i.e. what attention reads."""
        n = self.num_logical(layer)
        on_device = self.tier[layer, :n] == Tier.DEVICE
        return int(self.num_tokens[layer, :n][on_device].sum())

    def resident_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device slots of ``layer``'s resident tokens in logical order, and each token's logical block."""
        blocks = self.blocks_in(layer, Tier.DEVICE)
        counts = self.num_tokens[layer, blocks].to(torch.int64)
        offsets = torch.arange(self.block_size, dtype=torch.int64)
        slots = self.physical[layer, blocks, None] * self.block_size + offsets
        valid = offsets < counts[:, None]
        return slots[valid], blocks.repeat_interleave(counts)

    def move(self, layer: int, block: int, tier: Tier, physical: int = -1) -> None:
        """Record that ``layer``'s logical ``block`` now lives in ``tier`` at ``physical`` (-1 when dropped)."""
        self.tier[layer, block] = int(tier)
        self.physical[layer, block] = physical

    def reset(self) -> None:
        self.tier.fill_(int(Tier.UNUSED))
        self.physical.fill_(-1)
        self.num_tokens.zero_()
        self.seen = [0] * self.num_layers
