"""The runner: chunked prefill, the controller hook, budgets and the fallback rule, refused operations."""

import pytest
import torch
from transformers import DynamicCache

from cache.controller import CacheView, Decision, EvictOldest, Op, apply_decisions
from cache.paged_cache import CacheConfig, CacheOperationError, PagedKVCache
from cache.runner import Runner, budget_blocks
from cache.tiers import Tier


def ids_of(length, seed=7):
    return torch.randint(2, 256, (1, length), generator=torch.Generator().manual_seed(seed))


class RecordingController:
    """Never decides anything; records each view's device blocks and budget."""

    def __init__(self):
        self.views = []

    def decide(self, view: CacheView):
        self.views.append((view.seen, view.device_blocks().tolist(), view.budget_blocks.tolist()))
        return []


def test_full_cache_runner_matches_dynamic_cache_greedy(tiny_model):
    ids = ids_of(100)
    result = Runner(tiny_model, prefill_chunk=64).run(ids, max_new_tokens=30, stop_at_eos=False, keep_logits=True)
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        out = tiny_model(input_ids=ids, cache=cache, use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(29):
            out = tiny_model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    assert result.new_tokens == tokens
    assert result.decisions == 0 and result.fallbacks == 0
    assert result.blocks_per_tier["device"] == [-(-129 // 16)] * 2  # 100 + 29 tokens fed


def test_evict_oldest_keeps_budget_at_every_decision_and_evicts_oldest(tiny_model):
    ids = ids_of(150)
    result = Runner(tiny_model, controller=EvictOldest(), budget=4, prefill_chunk=32, decide_every=4).run(
        ids, max_new_tokens=40, stop_at_eos=False)
    cache = result.cache
    assert result.fallbacks == 0
    assert result.operations["evict"] > 0
    for layer in range(2):
        device = cache.tables.blocks_in(layer, Tier.DEVICE).tolist()
        n = cache.num_logical_blocks(layer)
        # sink block + the newest blocks: the oldest unpinned ones went first
        assert device == [0] + list(range(n - 3, n))
        assert cache.tables.count_in(layer, Tier.DROPPED) == n - 4
    assert cache.seen == 150 + 39


def test_fallback_enforces_budget_when_the_controller_does_nothing(tiny_model):
    controller = RecordingController()
    result = Runner(tiny_model, controller=controller, budget=3, prefill_chunk=32, decide_every=2).run(
        ids_of(120), max_new_tokens=20, stop_at_eos=False)
    assert result.fallbacks > 0
    assert result.operations.get("evict", 0) == 0
    # what a controller saw before the fallback could exceed the budget; after each decision point the cache
    # is within budget: the next view never shows more than budget + the blocks added since
    assert all(max(blocks) <= budget[0] + 2 for _, blocks, budget in controller.views[1:])
    assert max(result.blocks_per_tier["device"]) <= 3 + 1  # at most one block appended since the last decision


def test_fraction_budget_and_errors():
    assert budget_blocks(0.25, 1000, 16, 2, 2) == [16, 16]  # ceil(250 / 16)
    assert budget_blocks(8, 1000, 16, 2, 2) == [8, 8]
    assert budget_blocks([3, 9], 1000, 16, 2, 2) == [3, 9]
    assert budget_blocks(None, 1000, 16, 2, 2) is None
    with pytest.raises(ValueError, match="below the 2 pinned blocks"):
        budget_blocks(1, 1000, 16, 2, 2)
    with pytest.raises(ValueError, match="below the 2 pinned blocks"):
        budget_blocks(0.01, 1000, 16, 2, 2)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        budget_blocks(1.5, 1000, 16, 2, 2)
    with pytest.raises(ValueError, match="needs 2 entries"):
        budget_blocks([4], 1000, 16, 2, 2)


def test_prompt_longer_than_positions_is_refused_before_any_work(tiny_model):
    calls = []
    handle = tiny_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="exceeds the model's 1024 positions"):
            Runner(tiny_model).run(ids_of(1000), max_new_tokens=100)
    finally:
        handle.remove()
    assert calls == []


def test_budget_below_pinned_is_refused(tiny_model):
    with pytest.raises(ValueError, match="pinned"):
        Runner(tiny_model, budget=1).run(ids_of(50), max_new_tokens=2)


def test_sampling_is_seeded(tiny_model):
    runner = Runner(tiny_model)
    a = runner.run(ids_of(30), max_new_tokens=12, do_sample=True, seed=3, stop_at_eos=False).new_tokens
    b = runner.run(ids_of(30), max_new_tokens=12, do_sample=True, seed=3, stop_at_eos=False).new_tokens
    c = runner.run(ids_of(30), max_new_tokens=12, do_sample=True, seed=4, stop_at_eos=False).new_tokens
    assert a == b and a != c


@torch.no_grad()
def filled_cache(model, tokens=70, host_blocks=0):
    cache = PagedKVCache(model.config, CacheConfig(host_blocks=host_blocks))
    model(input_ids=ids_of(tokens), cache=cache, use_cache=True)
    return cache


def snapshot(cache):
    return (cache.tables.tier.clone(), cache.tables.physical.clone(),
            [cache.device_pool(layer).allocator.free_list() for layer in range(cache.num_layers)])


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.parametrize("operation, layer, block, message", [
    ("evict", 0, 0, "pinned"),          # the sink block
    ("evict", 1, 4, "pinned"),          # the newest block (70 tokens -> blocks 0..4)
    ("evict", 0, 5, "out of range"),
    ("evict", 2, 1, "layer 2 is out of range"),
    ("prefetch", 0, 1, "only HOST or DISK blocks"),
])
def test_refused_operations_leave_the_cache_unchanged(tiny_model, operation, layer, block, message):
    cache = filled_cache(tiny_model)
    before = snapshot(cache)
    with pytest.raises(CacheOperationError, match=message):
        getattr(cache, operation)(layer, block)
    assert same(before, snapshot(cache))


def test_prefetch_of_dropped_block_and_evict_of_evicted_block_are_refused(tiny_model):
    cache = filled_cache(tiny_model)
    assert cache.evict(0, 2) == Tier.DROPPED  # no host tier: dropped
    before = snapshot(cache)
    with pytest.raises(CacheOperationError, match="DROPPED"):
        cache.prefetch(0, 2)
    with pytest.raises(CacheOperationError, match="not on the device"):
        cache.evict(0, 2)
    with pytest.raises(CacheOperationError, match="not on the device"):
        apply_decisions(cache, [Decision(0, 2, Op.MERGE)])
    assert same(before, snapshot(cache))


def test_evict_goes_to_host_until_full_then_drops(tiny_model):
    cache = filled_cache(tiny_model, host_blocks=2)
    assert [cache.evict(0, b) for b in (1, 2, 3)] == [Tier.HOST, Tier.HOST, Tier.DROPPED]
    assert cache.tables.physical[0, 1:4].tolist() == [0, 1, -1]
    assert cache.device_pool(0).allocator.free_list()[-3:] == [1, 2, 3]  # freed to the tail, in order
    assert [entry["to"] for entry in cache.operation_log] == ["host", "host", "dropped"]


def test_enforce_budget_lowest_mass_rule(tiny_model):
    cache = filled_cache(tiny_model, tokens=90)  # blocks 0..5
    cache.stats.acc_mass[:, :6] = torch.tensor([9.0, 5.0, 1.0, 7.0, 0.5, 3.0])
    evicted = cache.enforce_budget([4, 3], rule="lowest_mass")
    assert evicted == 2 + 3
    # block 5 is the newest (pinned), block 0 the sink; lowest unpinned masses: 4 (0.5), 2 (1.0), 1 (5.0)
    assert cache.tables.blocks_in(0, Tier.DEVICE).tolist() == [0, 1, 3, 5]
    assert cache.tables.blocks_in(1, Tier.DEVICE).tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="unknown fallback rule"):
        cache.enforce_budget([4, 4], rule="random")


def test_teacher_forcing_feeds_the_given_tokens_and_keeps_their_logits(tiny_model):
    ids, forced = ids_of(50), [5, 6, 7, 8, 9]
    result = Runner(tiny_model).run(ids, forced_tokens=forced, keep_logits=True)
    assert result.new_tokens == forced and len(result.logits) == 5
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        out = tiny_model(input_ids=torch.cat([ids, torch.tensor([forced[:-1]])], dim=1), cache=cache, use_cache=True)
    expected = out.logits[0, -5:]
    assert (torch.stack(result.logits) - expected).abs().max().item() < 1e-4
