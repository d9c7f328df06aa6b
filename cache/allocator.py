"""Physical block allocation for one pool: a FIFO free list and reference counts.

Block ids are plain integers ``0 .. num_blocks-1``. The free list starts in ascending order (so a fresh
sequence gets physically contiguous blocks) and freed blocks go to its tail, as in vLLM's block pool.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """The pool has no free block left."""


class BlockAllocator:
    """Hands out physical block ids of one pool and tracks how many owners each has.

    ``allocate`` pops the head of the free list and sets the block's ref count to 1; ``fork`` adds an
    owner; ``free`` drops one and returns the block to the tail of the free list when none is left.
    Freeing a block that is already free raises (a double free is always a bookkeeping bug).
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def free_list(self) -> list[int]:
        """The free block ids in the order they will be handed out."""
        return list(self._free)

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref_counts[block]

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} blocks of the pool are in use")
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    def fork(self, block: int) -> int:
        """Add an owner to an allocated block (copy-on-write sharing); returns the block id."""
        self._check_id(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"cannot fork block {block}: it is free")
        self._ref_counts[block] += 1
        return block

    def free(self, block: int) -> None:
        self._check_id(block)
        if self._ref_counts[block] == 0:
            raise ValueError(f"double free of block {block}: it is already free")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)

    def reset(self) -> None:
        self._free = deque(range(self.num_blocks))
        self._ref_counts = [0] * self.num_blocks

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} is out of range 0..{self.num_blocks - 1}")
