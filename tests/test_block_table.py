"""Exact tests of ``cache.block_table.BlockTables`` driven by real ``BlockAllocator`` pools.

Every assertion names exact slots, logical ids, physical ids, tiers and token counts. A hypothesis test
interleaves appends and evictions of non-newest device blocks and checks the table against an independent
model (per-block tier / physical / token count, plus the allocator's FIFO free list) after every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache.allocator import BlockAllocator, OutOfBlocksError
from cache.block_table import BlockTables
from cache.tiers import Tier

BS = 4
DEVICE = int(Tier.DEVICE)
DROPPED = int(Tier.DROPPED)
UNUSED = int(Tier.UNUSED)


def _tiers(tables: BlockTables, layer: int) -> list[int]:
    return tables.tier[layer].tolist()


def _phys(tables: BlockTables, layer: int) -> list[int]:
    return tables.physical[layer].tolist()


def _ntok(tables: BlockTables, layer: int) -> list[int]:
    return tables.num_tokens[layer].tolist()


def _resident(tables: BlockTables, layer: int) -> tuple[list[int], list[int]]:
    slots, blocks = tables.resident_slots(layer)
    assert slots.dtype == torch.int64
    assert blocks.dtype == torch.int64
    return slots.tolist(), blocks.tolist()


# ---------------------------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------------------------


def test_fresh_tables_are_empty():
    t = BlockTables(num_layers=2, max_blocks=8, block_size=BS)
    assert t.tier.shape == (2, 8) and t.tier.dtype == torch.int8
    assert t.physical.shape == (2, 8) and t.physical.dtype == torch.int64
    assert t.num_tokens.shape == (2, 8) and t.num_tokens.dtype == torch.int32
    for layer in range(2):
        assert _tiers(t, layer) == [UNUSED] * 8
        assert _phys(t, layer) == [-1] * 8
        assert _ntok(t, layer) == [0] * 8
        assert t.seen[layer] == 0
        assert t.num_logical(layer) == 0
        assert t.resident_tokens(layer) == 0
        assert _resident(t, layer) == ([], [])
        assert t.blocks_in(layer, Tier.DEVICE).tolist() == []
        assert t.count_in(layer, Tier.DEVICE) == 0
        assert t.first_position(layer).tolist() == []


@pytest.mark.parametrize("bs", [0, -4])
def test_non_positive_block_size_raises(bs):
    with pytest.raises(ValueError, match="block_size must be positive"):
        BlockTables(num_layers=1, max_blocks=4, block_size=bs)


# ---------------------------------------------------------------------------------------------------------
# append
# ---------------------------------------------------------------------------------------------------------


def test_append_six_then_one_exact_slots_and_metadata():
    t = BlockTables(num_layers=2, max_blocks=8, block_size=BS)
    alloc0 = BlockAllocator(8)

    slots, logical = t.append(0, 6, alloc0)
    assert slots.dtype == torch.int64 and logical.dtype == torch.int64
    assert slots.tolist() == [0, 1, 2, 3, 4, 5]
    assert logical.tolist() == [0, 0, 0, 0, 1, 1]
    assert t.seen == [6, 0]
    assert t.num_logical(0) == 2
    assert _ntok(t, 0) == [4, 2, 0, 0, 0, 0, 0, 0]
    assert _tiers(t, 0) == [DEVICE, DEVICE] + [UNUSED] * 6
    assert _phys(t, 0) == [0, 1] + [-1] * 6
    assert alloc0.free_list() == [2, 3, 4, 5, 6, 7]
    assert [alloc0.ref_count(b) for b in range(8)] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert t.first_position(0).tolist() == [0, 4]
    assert t.blocks_in(0, Tier.DEVICE).tolist() == [0, 1]
    assert t.count_in(0, Tier.DEVICE) == 2
    # only logical blocks in use are reported: the UNUSED tail is not "in" any tier
    assert t.blocks_in(0, Tier.UNUSED).tolist() == []
    assert t.count_in(0, Tier.UNUSED) == 0
    assert t.resident_tokens(0) == 6
    assert _resident(t, 0) == ([0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 1, 1])

    # one more token fills the partial block 1: slot 6, no new allocation
    slots, logical = t.append(0, 1, alloc0)
    assert slots.tolist() == [6]
    assert logical.tolist() == [1]
    assert t.seen == [7, 0]
    assert t.num_logical(0) == 2
    assert _ntok(t, 0) == [4, 3, 0, 0, 0, 0, 0, 0]
    assert _tiers(t, 0) == [DEVICE, DEVICE] + [UNUSED] * 6
    assert _phys(t, 0) == [0, 1] + [-1] * 6
    assert alloc0.free_list() == [2, 3, 4, 5, 6, 7]
    assert t.resident_tokens(0) == 7
    assert _resident(t, 0) == ([0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 1, 1])

    # layer 1 is untouched
    assert t.seen[1] == 0
    assert t.num_logical(1) == 0
    assert _tiers(t, 1) == [UNUSED] * 8
    assert _phys(t, 1) == [-1] * 8
    assert _ntok(t, 1) == [0] * 8
    assert t.resident_tokens(1) == 0
    assert _resident(t, 1) == ([], [])


def test_append_crossing_block_boundary_from_partial_block():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    t.append(0, 3, alloc)
    slots, logical = t.append(0, 7, alloc)  # positions 3..9
    assert slots.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert logical.tolist() == [0, 1, 1, 1, 1, 2, 2]
    assert _ntok(t, 0) == [4, 4, 2, 0, 0, 0, 0, 0]
    assert _phys(t, 0) == [0, 1, 2] + [-1] * 5
    assert t.seen == [10]
    assert t.num_logical(0) == 3
    assert t.first_position(0).tolist() == [0, 4, 8]


def test_append_exactly_full_block_then_next_starts_new_block():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    slots, logical = t.append(0, 4, alloc)
    assert slots.tolist() == [0, 1, 2, 3]
    assert logical.tolist() == [0, 0, 0, 0]
    assert t.num_logical(0) == 1
    assert alloc.free_list() == [1, 2, 3, 4, 5, 6, 7]
    slots, logical = t.append(0, 1, alloc)
    assert slots.tolist() == [4]
    assert logical.tolist() == [1]
    assert _ntok(t, 0)[:3] == [4, 1, 0]
    assert alloc.free_list() == [2, 3, 4, 5, 6, 7]


def test_layers_are_independent_with_their_own_allocators():
    t = BlockTables(num_layers=2, max_blocks=8, block_size=BS)
    alloc0, alloc1 = BlockAllocator(8), BlockAllocator(8)
    t.append(0, 6, alloc0)
    t.append(0, 1, alloc0)

    # layer 1's own allocator starts at 0 too: its ids are independent of layer 0's
    slots, logical = t.append(1, 9, alloc1)
    assert slots.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert logical.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert _phys(t, 1) == [0, 1, 2] + [-1] * 5
    assert _ntok(t, 1) == [4, 4, 1, 0, 0, 0, 0, 0]
    assert _tiers(t, 1) == [DEVICE] * 3 + [UNUSED] * 5
    assert alloc1.free_list() == [3, 4, 5, 6, 7]
    assert t.seen == [7, 9]

    # layer 0 unchanged
    assert _phys(t, 0) == [0, 1] + [-1] * 6
    assert _ntok(t, 0) == [4, 3, 0, 0, 0, 0, 0, 0]
    assert alloc0.free_list() == [2, 3, 4, 5, 6, 7]

    # dropping in layer 1 does not touch layer 0
    t.move(1, 0, Tier.DROPPED)
    assert _tiers(t, 0) == [DEVICE, DEVICE] + [UNUSED] * 6
    assert t.resident_tokens(0) == 7
    assert t.resident_tokens(1) == 5


@pytest.mark.parametrize("n", [0, -1])
def test_append_non_positive_raises_without_side_effects(n):
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    with pytest.raises(ValueError, match="num_new must be positive"):
        t.append(0, n, alloc)
    assert t.seen == [0]
    assert alloc.free_list() == list(range(8))


def test_append_to_full_capacity_then_beyond_raises():
    t = BlockTables(num_layers=2, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    slots, logical = t.append(0, 32, alloc)  # exactly max_blocks * block_size
    assert slots.tolist() == list(range(32))
    assert logical.tolist() == [i // 4 for i in range(32)]
    assert _ntok(t, 0) == [4] * 8
    assert alloc.free_list() == []

    with pytest.raises(ValueError, match="33 tokens exceed the table's capacity of 32 tokens"):
        t.append(0, 1, alloc)
    # nothing changed
    assert t.seen[0] == 32
    assert _ntok(t, 0) == [4] * 8
    assert _phys(t, 0) == list(range(8))


def test_append_beyond_capacity_in_one_call_raises_and_allocates_nothing():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(16)
    t.append(0, 30, alloc)
    assert alloc.free_list() == list(range(8, 16))
    with pytest.raises(ValueError, match="capacity"):
        t.append(0, 5, alloc)  # 35 > 32
    assert t.seen == [30]
    assert alloc.free_list() == list(range(8, 16))
    assert _ntok(t, 0) == [4] * 7 + [2]
    # filling the last 2 slots still works
    slots, logical = t.append(0, 2, alloc)
    assert slots.tolist() == [30, 31]
    assert logical.tolist() == [7, 7]


@pytest.mark.parametrize("tier", [Tier.DROPPED, Tier.HOST, Tier.DISK])
def test_append_when_partial_newest_block_not_on_device_raises(tier):
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    t.append(0, 6, alloc)  # block 1 holds 2 tokens
    alloc.free(1)
    t.move(0, 1, tier, physical=-1 if tier == Tier.DROPPED else 5)
    with pytest.raises(RuntimeError, match="partially filled newest block 1 is not on the device"):
        t.append(0, 1, alloc)
    assert t.seen == [6]
    assert _ntok(t, 0)[:3] == [4, 2, 0]
    assert alloc.free_list() == [2, 3, 4, 5, 6, 7, 1]


def test_append_after_full_newest_block_dropped_starts_new_block():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    t.append(0, 8, alloc)  # blocks 0, 1 full
    alloc.free(1)
    t.move(0, 1, Tier.DROPPED)
    slots, logical = t.append(0, 2, alloc)
    # free list was [2..7, 1]: the new block gets physical 2
    assert slots.tolist() == [8, 9]
    assert logical.tolist() == [2, 2]
    assert _tiers(t, 0)[:4] == [DEVICE, DROPPED, DEVICE, UNUSED]
    assert _phys(t, 0)[:4] == [0, -1, 2, -1]


# ---------------------------------------------------------------------------------------------------------
# move / residency
# ---------------------------------------------------------------------------------------------------------


def test_move_dropped_excludes_block_from_residency_and_keeps_logical_order():
    t = BlockTables(num_layers=2, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    t.append(0, 14, alloc)  # blocks 0..3, 4/4/4/2 tokens, physical 0..3
    assert t.resident_tokens(0) == 14

    alloc.free(1)
    t.move(0, 1, Tier.DROPPED)
    assert _tiers(t, 0) == [DEVICE, DROPPED, DEVICE, DEVICE] + [UNUSED] * 4
    assert _phys(t, 0) == [0, -1, 2, 3] + [-1] * 4
    # token counts are kept for dropped blocks; seen and num_logical do not shrink
    assert _ntok(t, 0) == [4, 4, 4, 2, 0, 0, 0, 0]
    assert t.seen[0] == 14
    assert t.num_logical(0) == 4
    assert t.blocks_in(0, Tier.DEVICE).tolist() == [0, 2, 3]
    assert t.blocks_in(0, Tier.DROPPED).tolist() == [1]
    assert t.count_in(0, Tier.DEVICE) == 3
    assert t.count_in(0, Tier.DROPPED) == 1
    assert t.count_in(0, Tier.HOST) == 0
    assert t.resident_tokens(0) == 10
    assert _resident(t, 0) == (
        [0, 1, 2, 3, 8, 9, 10, 11, 12, 13],
        [0, 0, 0, 0, 2, 2, 2, 2, 3, 3],
    )

    alloc.free(0)
    t.move(0, 0, Tier.DROPPED)
    assert t.resident_tokens(0) == 6
    assert _resident(t, 0) == ([8, 9, 10, 11, 12, 13], [2, 2, 2, 2, 3, 3])
    assert t.blocks_in(0, Tier.DROPPED).tolist() == [0, 1]
    # the other layer is untouched
    assert t.resident_tokens(1) == 0


def test_move_to_host_records_physical_id_and_is_not_resident():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    t.append(0, 12, alloc)
    alloc.free(2)
    t.move(0, 2, Tier.HOST, physical=5)
    assert _tiers(t, 0)[:4] == [DEVICE, DEVICE, int(Tier.HOST), UNUSED]
    assert _phys(t, 0)[:4] == [0, 1, 5, -1]
    assert t.blocks_in(0, Tier.HOST).tolist() == [2]
    assert t.resident_tokens(0) == 8
    assert _resident(t, 0) == ([0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 1, 1, 1, 1])


def test_all_blocks_dropped_gives_empty_residency():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    t.append(0, 8, alloc)
    for b in (0, 1):
        alloc.free(b)
        t.move(0, b, Tier.DROPPED)
    assert t.resident_tokens(0) == 0
    assert _resident(t, 0) == ([], [])
    assert t.blocks_in(0, Tier.DEVICE).tolist() == []
    assert alloc.free_list() == [2, 3, 4, 5, 6, 7, 0, 1]


# ---------------------------------------------------------------------------------------------------------
# physical non-contiguity: freed blocks are reused with their new physical id
# ---------------------------------------------------------------------------------------------------------


def test_non_ascending_physical_ids_from_allocator():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(4)
    # someone else takes blocks 0, 1, 2, then frees 1 and 0: free list [3, 1, 0]
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    alloc.free(1)
    alloc.free(0)
    assert alloc.free_list() == [3, 1, 0]

    slots, logical = t.append(0, 10, alloc)
    assert _phys(t, 0)[:4] == [3, 1, 0, -1]
    assert slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 0, 1]
    assert logical.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert _resident(t, 0) == ([12, 13, 14, 15, 4, 5, 6, 7, 0, 1], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2])

    # the next token continues in logical block 2 = physical 0, offset 2
    slots, logical = t.append(0, 1, alloc)
    assert slots.tolist() == [2]
    assert logical.tolist() == [2]


def test_evicted_block_is_reused_with_new_physical_id():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(3)
    t.append(0, 8, alloc)  # logical 0 -> 0, logical 1 -> 1; free list [2]
    assert alloc.free_list() == [2]

    alloc.free(0)
    t.move(0, 0, Tier.DROPPED)
    assert alloc.free_list() == [2, 0]

    slots, logical = t.append(0, 8, alloc)  # logical 2 -> 2, logical 3 -> 0 (the reused block)
    assert slots.tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert logical.tolist() == [2, 2, 2, 2, 3, 3, 3, 3]
    assert _tiers(t, 0)[:5] == [DROPPED, DEVICE, DEVICE, DEVICE, UNUSED]
    assert _phys(t, 0)[:5] == [-1, 1, 2, 0, -1]
    assert alloc.free_list() == []
    assert t.resident_tokens(0) == 12
    slots, blocks = _resident(t, 0)
    assert slots == [4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3]
    assert blocks == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    # every resident slot is exactly physical * block_size + offset
    phys = t.physical[0]
    assert slots == [int(phys[b]) * BS + (i % BS) for i, b in enumerate(blocks)]

    # pool exhausted: the next block cannot be allocated
    with pytest.raises(OutOfBlocksError):
        t.append(0, 1, alloc)


def test_reset_clears_everything():
    t = BlockTables(num_layers=2, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(8)
    t.append(0, 9, alloc)
    t.append(1, 3, alloc)
    t.move(0, 1, Tier.DROPPED)
    t.reset()
    assert t.seen == [0, 0]
    for layer in range(2):
        assert _tiers(t, layer) == [UNUSED] * 8
        assert _phys(t, layer) == [-1] * 8
        assert _ntok(t, layer) == [0] * 8


def test_append_that_runs_out_of_blocks_changes_nothing():
    t = BlockTables(num_layers=1, max_blocks=8, block_size=BS)
    alloc = BlockAllocator(2)
    t.append(0, 4, alloc)  # logical 0 -> physical 0; free list [1]
    with pytest.raises(OutOfBlocksError):
        t.append(0, 8, alloc)  # needs 2 new blocks, 1 free: allocates 1, then fails
    assert t.seen == [4]
    # expected: the failed append gave physical 1 back
    assert alloc.free_list() == [1]


# ---------------------------------------------------------------------------------------------------------
# property test: appends interleaved with evictions of non-newest device blocks
# ---------------------------------------------------------------------------------------------------------

P_MAX_BLOCKS = 12
P_POOL = 6
P_LAYERS = 2

_op = st.one_of(
    st.tuples(st.just("append"), st.integers(0, P_LAYERS - 1), st.integers(1, 9)),
    st.tuples(st.just("evict"), st.integers(0, P_LAYERS - 1), st.integers(0, 10_000)),
)


def _check(t: BlockTables, allocs: list[BlockAllocator], model: list[dict], appended: list[int]):
    bs = t.block_size
    for layer in range(P_LAYERS):
        m = model[layer]
        alloc = allocs[layer]
        seen = t.seen[layer]
        assert seen == appended[layer]
        n = t.num_logical(layer)
        assert n == -(-seen // bs)
        assert int(t.num_tokens[layer, :n].sum()) == seen
        # exact table contents vs the independent model
        assert _tiers(t, layer) == m["tier"]
        assert _phys(t, layer) == m["phys"]
        assert _ntok(t, layer) == m["ntok"]
        assert alloc.free_list() == m["queue"]
        # all blocks but the newest are full
        assert all(x == bs for x in m["ntok"][: max(n - 1, 0)])
        # device blocks' physical ids: no duplicates, exactly the allocator's used set
        dev_blocks = t.blocks_in(layer, Tier.DEVICE).tolist()
        dev_phys = [int(t.physical[layer, b]) for b in dev_blocks]
        assert len(dev_phys) == len(set(dev_phys))
        used = {b for b in range(alloc.num_blocks) if alloc.ref_count(b) == 1}
        assert all(alloc.ref_count(b) in (0, 1) for b in range(alloc.num_blocks))
        assert set(dev_phys) == used
        assert alloc.num_used == len(dev_phys)
        # residency
        slots, blocks = t.resident_slots(layer)
        assert slots.numel() == t.resident_tokens(layer)
        assert blocks.numel() == slots.numel()
        bl = blocks.tolist()
        assert bl == sorted(bl)
        assert sorted(set(bl)) == dev_blocks
        expected_slots = []
        for b in dev_blocks:
            expected_slots += [m["phys"][b] * bs + o for o in range(m["ntok"][b])]
        assert slots.tolist() == expected_slots
        assert t.resident_tokens(layer) == sum(m["ntok"][b] for b in dev_blocks)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=25))
def test_append_evict_interleavings_keep_invariants(ops):
    t = BlockTables(num_layers=P_LAYERS, max_blocks=P_MAX_BLOCKS, block_size=BS)
    allocs = [BlockAllocator(P_POOL) for _ in range(P_LAYERS)]
    model = [
        {
            "tier": [UNUSED] * P_MAX_BLOCKS,
            "phys": [-1] * P_MAX_BLOCKS,
            "ntok": [0] * P_MAX_BLOCKS,
            "queue": list(range(P_POOL)),
        }
        for _ in range(P_LAYERS)
    ]
    appended = [0] * P_LAYERS
    _check(t, allocs, model, appended)

    for kind, layer, arg in ops:
        m = model[layer]
        if kind == "append":
            k = arg
            start = appended[layer]
            end = start + k
            n_before = -(-start // BS)
            last = (end - 1) // BS
            if last >= P_MAX_BLOCKS:
                with pytest.raises(ValueError, match="capacity"):
                    t.append(layer, k, allocs[layer])
                continue
            needed = last + 1 - n_before
            if needed > len(m["queue"]):
                with pytest.raises(OutOfBlocksError):  # refused atomically: nothing changes
                    t.append(layer, k, allocs[layer])
                _check(t, allocs, model, appended)
                continue
            slots, logical = t.append(layer, k, allocs[layer])
            for b in range(n_before, last + 1):
                m["phys"][b] = m["queue"].pop(0)
                m["tier"][b] = DEVICE
            exp_slots, exp_logical = [], []
            for pos in range(start, end):
                b = pos // BS
                exp_logical.append(b)
                exp_slots.append(m["phys"][b] * BS + pos % BS)
                m["ntok"][b] += 1
            assert slots.tolist() == exp_slots
            assert logical.tolist() == exp_logical
            appended[layer] = end
        else:
            n = -(-appended[layer] // BS)
            candidates = [b for b in range(n - 1) if m["tier"][b] == DEVICE]
            if not candidates:
                continue
            b = candidates[arg % len(candidates)]
            phys = int(t.physical[layer, b])
            assert phys == m["phys"][b]
            allocs[layer].free(phys)
            t.move(layer, b, Tier.DROPPED)
            m["queue"].append(phys)
            m["tier"][b] = DROPPED
            m["phys"][b] = -1
        _check(t, allocs, model, appended)
