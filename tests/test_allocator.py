"""Exact tests of ``cache.allocator.BlockAllocator`` (FIFO free list, ref counts, fork, free).

Style follows vLLM's block pool tests: every assertion names the exact block ids, the exact free-list
order and the exact ref counts; a stateful hypothesis test checks the allocator against an independent
model (a dict of ref counts and a list used as a FIFO queue) after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache.allocator import BlockAllocator, OutOfBlocksError

# ---------------------------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------------------------


def test_fresh_pool_free_list_is_ascending_and_all_ref_counts_zero():
    alloc = BlockAllocator(5)
    assert alloc.num_blocks == 5
    assert alloc.free_list() == [0, 1, 2, 3, 4]
    assert alloc.num_free == 5
    assert alloc.num_used == 0
    assert [alloc.ref_count(b) for b in range(5)] == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("n", [0, -1, -8])
def test_non_positive_num_blocks_raises(n):
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockAllocator(n)


def test_single_block_pool():
    alloc = BlockAllocator(1)
    assert alloc.allocate() == 0
    assert alloc.free_list() == []
    with pytest.raises(OutOfBlocksError):
        alloc.allocate()
    alloc.free(0)
    assert alloc.free_list() == [0]
    assert alloc.allocate() == 0


# ---------------------------------------------------------------------------------------------------------
# allocation order: FIFO, freed blocks to the tail
# ---------------------------------------------------------------------------------------------------------


def test_allocate_hands_out_ascending_ids():
    alloc = BlockAllocator(8)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    assert alloc.free_list() == [3, 4, 5, 6, 7]
    assert alloc.num_free == 5
    assert alloc.num_used == 3
    assert [alloc.ref_count(b) for b in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]


def test_freed_block_goes_to_tail_not_head():
    alloc = BlockAllocator(8)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    alloc.free(1)
    assert alloc.free_list() == [3, 4, 5, 6, 7, 1]
    assert alloc.ref_count(1) == 0
    # the next allocation takes the head (3), not the just-freed block 1
    assert alloc.allocate() == 3
    assert alloc.free_list() == [4, 5, 6, 7, 1]
    # drain the original tail, then the freed block comes back last
    assert [alloc.allocate() for _ in range(4)] == [4, 5, 6, 7]
    assert alloc.free_list() == [1]
    assert alloc.allocate() == 1
    assert alloc.free_list() == []
    assert alloc.num_free == 0
    assert alloc.num_used == 8
    assert [alloc.ref_count(b) for b in range(8)] == [1] * 8


def test_freed_blocks_come_back_in_free_order():
    alloc = BlockAllocator(4)
    assert [alloc.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert alloc.free_list() == []
    alloc.free(2)
    alloc.free(0)
    alloc.free(3)
    assert alloc.free_list() == [2, 0, 3]
    assert [alloc.allocate() for _ in range(3)] == [2, 0, 3]
    alloc.free(1)
    assert alloc.free_list() == [1]
    assert alloc.allocate() == 1


def test_interleaved_allocate_free_exact_sequence():
    alloc = BlockAllocator(4)
    assert alloc.allocate() == 0
    assert alloc.allocate() == 1
    alloc.free(0)
    assert alloc.free_list() == [2, 3, 0]
    assert alloc.allocate() == 2
    alloc.free(1)
    assert alloc.free_list() == [3, 0, 1]
    assert alloc.allocate() == 3
    assert alloc.allocate() == 0
    assert alloc.allocate() == 1
    assert alloc.free_list() == []
    assert alloc.num_used == 4


def test_out_of_blocks_raises_and_leaves_state_unchanged():
    alloc = BlockAllocator(3)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OutOfBlocksError, match="all 3 blocks"):
        alloc.allocate()
    assert alloc.free_list() == []
    assert alloc.num_used == 3
    assert [alloc.ref_count(b) for b in range(3)] == [1, 1, 1]


def test_out_of_blocks_is_a_runtime_error():
    assert issubclass(OutOfBlocksError, RuntimeError)


# ---------------------------------------------------------------------------------------------------------
# ref counts: fork / free
# ---------------------------------------------------------------------------------------------------------


def test_fork_increments_ref_count_and_returns_id():
    alloc = BlockAllocator(4)
    b = alloc.allocate()
    assert b == 0
    assert alloc.fork(b) == 0
    assert alloc.ref_count(0) == 2
    assert alloc.fork(b) == 0
    assert alloc.ref_count(0) == 3
    # forking allocates nothing
    assert alloc.free_list() == [1, 2, 3]
    assert alloc.num_used == 1


def test_shared_block_returns_to_free_list_only_after_last_owner_frees():
    alloc = BlockAllocator(4)
    assert alloc.allocate() == 0
    assert alloc.allocate() == 1
    alloc.fork(0)
    assert alloc.ref_count(0) == 2

    alloc.free(0)
    assert alloc.ref_count(0) == 1
    assert alloc.free_list() == [2, 3]
    assert alloc.num_used == 2

    alloc.free(0)
    assert alloc.ref_count(0) == 0
    assert alloc.free_list() == [2, 3, 0]
    assert alloc.num_used == 1

    with pytest.raises(ValueError, match="double free"):
        alloc.free(0)


def test_three_owners_three_frees():
    alloc = BlockAllocator(2)
    assert alloc.allocate() == 0
    alloc.fork(0)
    alloc.fork(0)
    assert alloc.ref_count(0) == 3
    alloc.free(0)
    alloc.free(0)
    assert alloc.ref_count(0) == 1
    assert alloc.free_list() == [1]
    alloc.free(0)
    assert alloc.ref_count(0) == 0
    assert alloc.free_list() == [1, 0]


def test_fork_of_free_block_raises():
    alloc = BlockAllocator(4)
    with pytest.raises(ValueError, match="cannot fork block 2: it is free"):
        alloc.fork(2)
    assert alloc.ref_count(2) == 0
    assert alloc.free_list() == [0, 1, 2, 3]


def test_reallocated_block_has_ref_count_one():
    alloc = BlockAllocator(1)
    assert alloc.allocate() == 0
    alloc.fork(0)
    alloc.free(0)
    alloc.free(0)
    assert alloc.allocate() == 0
    assert alloc.ref_count(0) == 1


# ---------------------------------------------------------------------------------------------------------
# errors: double free, out of range
# ---------------------------------------------------------------------------------------------------------


def test_double_free_raises_and_does_not_corrupt_free_list():
    alloc = BlockAllocator(4)
    assert alloc.allocate() == 0
    alloc.free(0)
    assert alloc.free_list() == [1, 2, 3, 0]
    with pytest.raises(ValueError, match="double free"):
        alloc.free(0)
    # the block is not appended a second time
    assert alloc.free_list() == [1, 2, 3, 0]
    assert alloc.ref_count(0) == 0
    assert alloc.num_free == 4


def test_free_of_never_allocated_block_is_a_double_free():
    alloc = BlockAllocator(4)
    with pytest.raises(ValueError, match="double free of block 3"):
        alloc.free(3)
    assert alloc.free_list() == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [-1, 4, 100])
@pytest.mark.parametrize("op", ["free", "fork", "ref_count"])
def test_out_of_range_id_raises(op, bad):
    alloc = BlockAllocator(4)
    alloc.allocate()
    with pytest.raises(ValueError, match="out of range 0..3"):
        getattr(alloc, op)(bad)
    assert alloc.free_list() == [1, 2, 3]
    assert [alloc.ref_count(b) for b in range(4)] == [1, 0, 0, 0]


def test_reset_restores_fresh_state():
    alloc = BlockAllocator(4)
    for _ in range(3):
        alloc.allocate()
    alloc.fork(1)
    alloc.free(0)
    alloc.reset()
    assert alloc.free_list() == [0, 1, 2, 3]
    assert [alloc.ref_count(b) for b in range(4)] == [0, 0, 0, 0]
    assert alloc.num_used == 0
    assert [alloc.allocate() for _ in range(2)] == [0, 1]


# ---------------------------------------------------------------------------------------------------------
# stateful model check
# ---------------------------------------------------------------------------------------------------------

POOL = 8


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / fork / free against a dict-of-ref-counts + FIFO-list model."""

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(POOL)
        self.model_refs: dict[int, int] = {b: 0 for b in range(POOL)}
        self.model_queue: list[int] = list(range(POOL))

    def _used(self) -> list[int]:
        return sorted(b for b, r in self.model_refs.items() if r > 0)

    @rule()
    def allocate(self):
        if not self.model_queue:
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate()
            return
        expected = self.model_queue.pop(0)
        got = self.alloc.allocate()
        assert got == expected
        self.model_refs[expected] = 1

    @precondition(lambda self: any(r > 0 for r in self.model_refs.values()))
    @rule(data=st.data())
    def fork(self, data):
        b = data.draw(st.sampled_from(self._used()), label="fork block")
        assert self.alloc.fork(b) == b
        self.model_refs[b] += 1

    @precondition(lambda self: any(r > 0 for r in self.model_refs.values()))
    @rule(data=st.data())
    def free(self, data):
        b = data.draw(st.sampled_from(self._used()), label="free block")
        self.alloc.free(b)
        self.model_refs[b] -= 1
        if self.model_refs[b] == 0:
            self.model_queue.append(b)

    @precondition(lambda self: bool(self.model_queue))
    @rule(data=st.data())
    def free_free_block(self, data):
        b = data.draw(st.sampled_from(self.model_queue), label="double free block")
        with pytest.raises(ValueError, match="double free"):
            self.alloc.free(b)

    @precondition(lambda self: bool(self.model_queue))
    @rule(data=st.data())
    def fork_free_block(self, data):
        b = data.draw(st.sampled_from(self.model_queue), label="fork of free block")
        with pytest.raises(ValueError, match="it is free"):
            self.alloc.fork(b)

    @rule(bad=st.one_of(st.integers(max_value=-1), st.integers(min_value=POOL)))
    def out_of_range(self, bad):
        with pytest.raises(ValueError, match="out of range"):
            self.alloc.free(bad)

    @invariant()
    def matches_model(self):
        alloc = self.alloc
        free = alloc.free_list()
        assert free == self.model_queue
        refs = [alloc.ref_count(b) for b in range(POOL)]
        assert refs == [self.model_refs[b] for b in range(POOL)]
        assert alloc.num_free == len(self.model_queue)
        assert alloc.num_free + alloc.num_used == POOL
        used = {b for b in range(POOL) if refs[b] > 0}
        assert not (set(free) & used)
        assert len(set(free)) == len(free)
        assert set(free) | used == set(range(POOL))
        assert all(refs[b] == 0 for b in free)
        assert alloc.num_used == len(used)


AllocatorMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorStateful = AllocatorMachine.TestCase
