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
        # Python mirrors of hot facts, so a decode step needs no tensor reads
        self._device_count = [0] * num_layers
        self._newest_physical = [-1] * num_layers  # physical id of the newest block while it is on the device

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
        All or nothing: when the pool lacks blocks, ``OutOfBlocksError`` is raised and nothing changes.
        """
        if num_new <= 0:
            raise ValueError(f"num_new must be positive, got {num_new}")
        bs = self.block_size
        start = self.seen[layer]
        end = start + num_new
        first_new_block, last_block = self._reserve_blocks(layer, start, end, allocator)
        positions = torch.arange(start, end, dtype=torch.int64)
        logical = positions // bs
        slots = self.physical[layer, logical] * bs + positions % bs
        first_block = start // bs
        counts = torch.bincount(logical - first_block, minlength=last_block - first_block + 1)
        self.num_tokens[layer, first_block : last_block + 1] += counts.to(torch.int32)
        self.seen[layer] = end
        return slots, logical

    def append_one(self, layer: int, allocator: BlockAllocator) -> tuple[int, int, int]:
        """Fast path of ``append`` for one token (a decode step): returns ``(physical, offset, logical)``."""
        start = self.seen[layer]
        block, offset = divmod(start, self.block_size)
        self._reserve_blocks(layer, start, start + 1, allocator)
        self.num_tokens[layer, block] += 1
        self.seen[layer] = start + 1
        return self._newest_physical[layer], offset, block

    def _reserve_blocks(self, layer: int, start: int, end: int, allocator: BlockAllocator) -> tuple[int, int]:
        """Allocate the device blocks that tokens ``start..end-1`` need; returns (first new, last block)."""
        bs = self.block_size
        last_block = (end - 1) // bs
        if last_block >= self.max_blocks:
            raise ValueError(
                f"layer {layer}: {end} tokens exceed the table's capacity of {self.max_blocks * bs} tokens"
            )
        first_new_block = -(-start // bs)
        if start % bs and self._newest_physical[layer] < 0:
            raise RuntimeError(f"layer {layer}: the partially filled newest block {start // bs} is not on the device")
        needed = last_block + 1 - first_new_block
        if needed > allocator.num_free:
            raise OutOfBlocksError(
                f"layer {layer}: {end - start} new tokens need {needed} free blocks, the device pool has "
                f"{allocator.num_free}; raise CacheConfig.device_blocks or lower the budget"
            )
        if needed:
            ids = [allocator.allocate() for _ in range(needed)]
            self.physical[layer, first_new_block : last_block + 1] = torch.tensor(ids, dtype=torch.int64)
            self.tier[layer, first_new_block : last_block + 1] = int(Tier.DEVICE)
            self._device_count[layer] += needed
            self._newest_physical[layer] = ids[-1]
        return first_new_block, last_block

    def blocks_in(self, layer: int, tier: Tier) -> torch.Tensor:
        """Logical ids of ``layer``'s blocks in ``tier``, ascending (int64)."""
        n = self.num_logical(layer)
        return torch.nonzero(self.tier[layer, :n] == tier).flatten()

    def count_in(self, layer: int, tier: Tier) -> int:
        if tier == Tier.DEVICE:
            return self._device_count[layer]
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
        was_on_device = int(self.tier[layer, block]) == Tier.DEVICE
        self._device_count[layer] += int(tier == Tier.DEVICE) - int(was_on_device)
        if block == self.num_logical(layer) - 1:
            self._newest_physical[layer] = physical if tier == Tier.DEVICE else -1
        self.tier[layer, block] = int(tier)
        self.physical[layer, block] = physical

    def drop(self, layers: list[int], blocks: list[int]) -> None:
        """Record that each device block ``(layers[i], blocks[i])`` is gone (merged away): ``move`` to
        ``DROPPED`` for many blocks at once. The caller checked they are distinct and on the device."""
        for layer, block in zip(layers, blocks, strict=True):
            self._device_count[layer] -= 1
            if block == self.num_logical(layer) - 1:
                self._newest_physical[layer] = -1
        index = (torch.tensor(layers, dtype=torch.int64), torch.tensor(blocks, dtype=torch.int64))
        self.tier[index] = int(Tier.DROPPED)
        self.physical[index] = -1

    def reset(self) -> None:
        self.tier.fill_(int(Tier.UNUSED))
        self.physical.fill_(-1)
        self.num_tokens.zero_()
        self.seen = [0] * self.num_layers
        self._device_count = [0] * self.num_layers
        self._newest_physical = [-1] * self.num_layers
