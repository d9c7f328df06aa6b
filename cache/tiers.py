"""Memory tiers and the physical block pool each tier keeps per layer."""

from __future__ import annotations

import math
from enum import IntEnum
from pathlib import Path

import torch

from cache.allocator import BlockAllocator


class Tier(IntEnum):
    """Where a logical block's keys and values live. Only ``DEVICE`` blocks are attended.

    ``DROPPED`` is not a tier: the block's content is gone (evicted with nowhere to go, or merged into
    other blocks); it is a cache miss if it is ever needed again. ``UNUSED`` marks entries past the end.
    """

    DEVICE = 0
    HOST = 1
    DISK = 2
    DROPPED = 3
    UNUSED = -1


class TierPool:
    """The physical storage of one tier for one layer, allocated once, and its allocator.

    - ``keys``, ``values``: ``[num_blocks, block_size, kv_heads, head_dim]``;
    - ``log_weights``: ``[num_blocks, block_size, kv_heads]`` fp32, the log of how many tokens each slot
      stands for (0 for a plain token; raised by merges and added to attention scores).

    ``device``/``host`` pools are tensors (host is pinned when CUDA is present); a ``disk`` pool lives in
    memory-mapped files ``<disk_dir>/layer<i>.{keys,values,weights}`` (``close`` deletes them). ``storage``
    gives the three tensors instead of allocating them (the cache stacks every layer's device pool in one
    tensor so that batched operations index all layers at once; each layer's pool is a view of its row).
    """

    def __init__(self, tier: Tier, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, disk_dir: Path | None = None, layer: int = 0,
                 storage: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        self.tier = tier
        self.block_size = block_size
        self.dtype = dtype
        self.kv_shape = (num_blocks, block_size, kv_heads, head_dim)
        self.weight_shape = (num_blocks, block_size, kv_heads)
        self.has_merged = False  # any slot with a non-zero log weight; lets the common path skip weights
        self.allocator = BlockAllocator(num_blocks)
        self.files: list[Path] = []
        if tier == Tier.DISK:
            if disk_dir is None:
                raise ValueError("a disk tier needs a folder for its memory-mapped files (disk_dir)")
            disk_dir.mkdir(parents=True, exist_ok=True)
            self.files = [disk_dir / f"layer{layer}.{part}" for part in ("keys", "values", "weights")]
            self._map_files(create=True)
        elif storage is not None:  # views into storage shared with other layers (the cache's stacked pools)
            self.keys, self.values, self.log_weights = storage
            if (tuple(self.keys.shape) != self.kv_shape or tuple(self.values.shape) != self.kv_shape
                    or tuple(self.log_weights.shape) != self.weight_shape):
                raise ValueError(f"TierPool storage has shapes {tuple(self.keys.shape)} / {tuple(self.log_weights.shape)}, "
                                 f"expected {self.kv_shape} / {self.weight_shape}")
        else:
            pin = tier == Tier.HOST and torch.cuda.is_available()
            self.keys = torch.empty(self.kv_shape, dtype=dtype, device=device, pin_memory=pin)
            self.values = torch.empty(self.kv_shape, dtype=dtype, device=device, pin_memory=pin)
            self.log_weights = torch.zeros(self.weight_shape, dtype=torch.float32, device=device, pin_memory=pin)

    def _map_files(self, create: bool) -> None:
        if create:
            for path, shape, dtype in zip(self.files, (self.kv_shape, self.kv_shape, self.weight_shape),
                                          (self.dtype, self.dtype, torch.float32), strict=True):
                with open(path, "wb") as f:
                    f.truncate(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        keys, values, weights = self.files
        self.keys = torch.from_file(str(keys), shared=True, size=math.prod(self.kv_shape),
                                    dtype=self.dtype).view(self.kv_shape)
        self.values = torch.from_file(str(values), shared=True, size=math.prod(self.kv_shape),
                                      dtype=self.dtype).view(self.kv_shape)
        self.log_weights = torch.from_file(str(weights), shared=True, size=math.prod(self.weight_shape),
                                           dtype=torch.float32).view(self.weight_shape)

    def reopen(self) -> None:
        """Drop the memory maps and map the disk files again (their content survives)."""
        if self.tier != Tier.DISK:
            raise ValueError(f"only a disk pool can be reopened, this one is {self.tier.name}")
        del self.keys, self.values, self.log_weights
        self._map_files(create=False)

    def close(self) -> None:
        """Release the storage; a disk pool deletes its files."""
        for name in ("keys", "values", "log_weights"):
            if hasattr(self, name):
                delattr(self, name)
        for path in self.files:
            path.unlink(missing_ok=True)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block's keys plus values (the log weights are bookkeeping, not counted)."""
        return 2 * math.prod(self.kv_shape[1:]) * torch.empty((), dtype=self.dtype).element_size()

    def flat_keys(self) -> torch.Tensor:
        """``[num_blocks * block_size, kv_heads, head_dim]`` view: one row per token slot."""
        return self.keys.view(-1, *self.keys.shape[2:])

    def flat_values(self) -> torch.Tensor:
        return self.values.view(-1, *self.values.shape[2:])

    def flat_log_weights(self) -> torch.Tensor:
        return self.log_weights.view(-1, self.log_weights.shape[2])

    def copy_block(self, source: TierPool, source_block: int, target_block: int) -> None:
        """Copy one block's keys, values and log weights from ``source`` into this pool."""
        self.keys[target_block].copy_(source.keys[source_block], non_blocking=True)
        self.values[target_block].copy_(source.values[source_block], non_blocking=True)
        if source.has_merged or self.has_merged:
            self.log_weights[target_block].copy_(source.log_weights[source_block], non_blocking=True)
            self.has_merged = True

    def clear_weights(self, block: int) -> None:
        """Reset a reused block's log weights (only needed once the pool has seen a merge)."""
        if self.has_merged:
            self.log_weights[block].zero_()
