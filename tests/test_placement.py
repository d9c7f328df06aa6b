"""A decision as device masks (``cache.placement``): applied whole it leaves the cache exactly as the same decisions
applied one by one through ``apply_decisions``' list path (the reference), and a placement the cache cannot
apply is refused with nothing changed."""

import dataclasses

import numpy as np
import pytest
import torch

from cache.controller import CacheView, Op, apply_decisions
from cache.errors import CacheOperationError
from cache.placement import Placement
from cache.ranking import keep_top
from cache.tiers import Tier
from tests.test_ranking import view_after_prefill


def state(cache):
    """Everything a decision changes: tiers, the resident keys and values of every layer, bytes moved."""
    n = cache.num_logical_blocks()
    resident = [cache.resident_keys_values(layer) for layer in range(cache.num_layers)]
    return cache.tables.tier[:, :n].clone(), resident, dict(cache.bytes_moved)


def same(a, b) -> bool:
    (tier_a, kv_a, moved_a), (tier_b, kv_b, moved_b) = a, b
    return (torch.equal(tier_a, tier_b) and moved_a == moved_b
            and all(torch.equal(x, y) for pair_a, pair_b in zip(kv_a, kv_b, strict=True)
                    for x, y in zip(pair_a, pair_b, strict=True)))


@pytest.mark.parametrize("host_blocks", [8, 0])
def test_a_placement_applies_as_its_decisions_one_by_one(tiny_model, host_blocks):
    """Two copies of one prefill in lockstep: one applies each placement whole, the other its decisions one by
    one; a third gets the first round's decisions less the last one (a negative control the check must tell)."""
    rng = np.random.default_rng(0)
    cache, view = view_after_prefill(tiny_model, host_blocks=host_blocks)
    reference, wrong = cache.clone(), cache.clone()
    n = view.num_blocks
    operations = dict.fromkeys(Op, 0)
    for round_, budget in enumerate(([6, 4], [3, 9], [9, 2], [5, 5])):
        view = CacheView.from_cache(cache, budget, phase="compress")
        placement = keep_top(view, rng.normal(size=(2, n)), merge=rng.normal(size=(2, n)))
        decisions = list(placement)
        for decision in decisions:
            operations[decision.op] += 1
        counts = apply_decisions(cache, placement)
        assert apply_decisions(reference, decisions) == counts
        assert same(state(cache), state(reference))
        if round_ == 0:
            apply_decisions(wrong, decisions[:-1])
            assert not same(state(cache), state(wrong))
        device = (cache.tables.tier[:, :n] == Tier.DEVICE).numpy()
        assert np.array_equal(device, placement.device)
        assert (device.sum(axis=1) <= np.maximum(budget, view.pinned.sum(dim=1).numpy())).all()
    assert operations[Op.EVICT] and operations[Op.MERGE]  # the rounds exercised every kind of move
    assert operations[Op.PREFETCH] or host_blocks == 0
    reference.close(), wrong.close()


def test_a_placement_the_cache_cannot_apply_is_refused_whole(tiny_model):
    cache, view = view_after_prefill(tiny_model, host_blocks=0)
    n = view.num_blocks
    oldest_first = np.arange(n, dtype=np.float64)[::-1].repeat(2).reshape(n, 2).T.copy()
    placement = keep_top(view, oldest_first)
    before = state(cache)

    def refused(bad: Placement, match: str):
        with pytest.raises(CacheOperationError, match=match):
            apply_decisions(cache, bad)
        assert same(state(cache), before)  # nothing changed

    unpinned = placement.device.copy()
    unpinned[1, 0] = False  # the sink block
    refused(dataclasses.replace(placement, device=unpinned), "pinned")
    refused(dataclasses.replace(placement, device=placement.device[:, :-1]), "shape")
    apply_decisions(cache, placement)  # blocks 4.. n-2 dropped (no host tier)
    before = state(cache)
    refused(placement, "stale")  # decided against the tiers before it was applied
    view = CacheView.from_cache(cache, [5, 5], phase="compress")
    back = keep_top(view, oldest_first)
    device = back.device.copy()
    device[0, n - 2] = True  # dropped: its content is gone
    refused(dataclasses.replace(back, device=device), "dropped")
    assert len(back) == 0 and list(back) == []  # the same scores again: nothing to move
