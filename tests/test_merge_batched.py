"""Batched merges (``PagedKVCache.merge_blocks``), the mirror compaction behind evict / merge, and the batched
``apply_decisions``: checked against an independent per-token reference, against one-by-one application,
and for refusals that must leave the cache unchanged. No timing asserts."""

from types import SimpleNamespace

import pytest
import torch

from cache.attention import paged_attention_forward
from cache.controller import Decision, Op, apply_decisions
from cache.paged_cache import CacheConfig, CacheOperationError, PagedKVCache
from cache.tiers import Tier

KV_HEADS, DIM, BS = 2, 16, 16


def synthetic(layers=3, tokens=100, seed=0, duplicate=None):
    """A cache of ``layers`` layers written directly through ``update`` (random keys and values, a different
    draw per layer). ``duplicate=(a, b)``: block ``a``'s keys equal block ``b``'s in every layer."""
    config = SimpleNamespace(num_hidden_layers=layers, max_position_embeddings=512)
    cache = PagedKVCache(config, CacheConfig(block_size=BS))
    generator = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        keys = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        values = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        if duplicate is not None:
            a, b = duplicate
            keys[:, :, a * BS : (a + 1) * BS] = keys[:, :, b * BS : (b + 1) * BS]
        cache.update(keys, values, layer)
    return cache


def pool_tokens(cache, layer):
    """The layer's resident tokens read from the device pool through the block table, in logical order:
    positions [R], keys / values [R, kv, dim], log weights [R, kv]."""
    pool = cache.device_pool(layer)
    slots, blocks = cache.tables.resident_slots(layer)
    positions = blocks * BS + slots % BS
    return positions, pool.flat_keys()[slots], pool.flat_values()[slots], pool.flat_log_weights()[slots]


def mirror_tokens(cache, layer):
    """The same tokens read from the resident mirror (sorted by position)."""
    keys, values = cache.resident_keys_values(layer)
    state = cache.layers[layer]
    state._sync_positions()
    positions = state.mirror_positions[: state.resident]
    order = torch.argsort(positions)
    weights = state.mirror_log_weights[:, : state.resident].T
    return positions[order], keys[0].transpose(0, 1)[order], values[0].transpose(0, 1)[order], weights[order]


def reference_merge(tokens, blocks):
    """Per-token reference of the merge rule: every token of ``blocks``, per KV head, joins the kept token
    with the most cosine-similar key; kept slots become the weight-averaged key/value, log weight = log of the
    summed weights. Returns the kept tokens as ``pool_tokens`` does."""
    positions, keys, values, log_weights = tokens
    source = torch.isin(positions // BS, torch.tensor(blocks))
    kept = ~source
    weight = log_weights.exp()
    key_sum = keys[kept] * weight[kept][..., None]
    value_sum = values[kept] * weight[kept][..., None]
    weight_sum = weight[kept].clone()
    kept_keys = keys[kept]
    for i in source.nonzero().flatten().tolist():
        for head in range(KV_HEADS):
            cosine = torch.nn.functional.cosine_similarity(keys[i, head][None], kept_keys[:, head], dim=-1)
            target = int(cosine.argmax())
            key_sum[target, head] += weight[i, head] * keys[i, head]
            value_sum[target, head] += weight[i, head] * values[i, head]
            weight_sum[target, head] += weight[i, head]
    return (positions[kept], key_sum / weight_sum[..., None], value_sum / weight_sum[..., None], weight_sum.log())


def attention(cache, layer, query):
    module = SimpleNamespace(layer_idx=layer, num_key_value_groups=2, is_causal=True)
    key, value = cache.resident_keys_values(layer)
    output, _ = paged_attention_forward(module, query, key, value, None, scaling=0.25, paged_cache=cache)
    return output


def assert_tokens_close(actual, expected, atol=1e-5):
    assert torch.equal(actual[0], expected[0])
    for a, e in zip(actual[1:], expected[1:], strict=True):
        assert torch.allclose(a, e, atol=atol), (a - e).abs().max()


@pytest.mark.parametrize("chunk", [None, 1])
def test_merge_blocks_matches_a_per_token_reference_across_layers(chunk, monkeypatch):
    if chunk is not None:  # the bulk path: similarities in chunks of sources (here one source at a time)
        monkeypatch.setattr("cache.merging.MERGE_CHUNK", chunk)
    cache = synthetic()
    batch = {0: [1], 1: [2, 4], 2: [3]}  # two blocks of layer 1 in one batch: they fold into what stays
    before = {layer: pool_tokens(cache, layer) for layer in batch}
    folded = cache.merge_blocks([(0, 1), (1, 2), (2, 3), (1, 4)])
    assert folded == [BS * KV_HEADS] * 4
    for layer, blocks in batch.items():
        expected = reference_merge(before[layer], blocks)
        assert_tokens_close(pool_tokens(cache, layer), expected)  # the pool, through the table
        assert_tokens_close(mirror_tokens(cache, layer), expected)  # the mirror attention reads
        assert cache.tables.tier[layer, blocks].tolist() == [Tier.DROPPED] * len(blocks)
        assert cache.device_pool(layer).allocator.num_used == cache.tables.count_in(layer, Tier.DEVICE)
    assert [entry["op"] for entry in cache.operation_log[-4:]] == ["merge"] * 4
    # the key summaries of every device block equal a fresh computation from the pool
    for layer in batch:
        positions, keys, _, _ = pool_tokens(cache, layer)
        for block in cache.tables.blocks_in(layer, Tier.DEVICE).tolist():
            block_keys = keys[positions // BS == block]
            assert torch.allclose(cache.stats.key_sum[layer, block], block_keys.sum(dim=0), atol=1e-5)
            assert torch.equal(cache.stats.key_min[layer, block], block_keys.amin(dim=0))
            assert torch.equal(cache.stats.key_max[layer, block], block_keys.amax(dim=0))


def test_one_block_per_layer_in_a_batch_equals_one_merge_at_a_time():
    batched, single = synthetic(seed=3), synthetic(seed=3)
    batched.merge_blocks([(layer, 2) for layer in range(3)])
    for layer in range(3):
        single.merge(layer, 2)
    for layer in range(3):
        assert_tokens_close(pool_tokens(batched, layer), pool_tokens(single, layer), atol=1e-6)


def test_batched_merge_of_duplicate_keys_is_exact_in_every_layer():
    cache = synthetic(duplicate=(2, 4))
    query = torch.randn(1, 4, 1, DIM, generator=torch.Generator().manual_seed(1))
    before = [attention(cache, layer, query) for layer in range(3)]
    assert cache.merge_blocks([(layer, 2) for layer in range(3)]) == [BS * KV_HEADS] * 3
    for layer in range(3):
        assert (attention(cache, layer, query) - before[layer]).abs().max().item() < 1e-5
    # negative control: without the log-count bias the same merged keys/values are not exact
    cache.device_pool(0).has_merged = False
    assert (attention(cache, 0, query) - before[0]).abs().max().item() > 1e-3


def snapshot(cache):
    stack = cache._stacks[0]
    tensors = [cache.tables.tier, cache.tables.physical, stack.pool_keys, stack.pool_values, stack.pool_log_weights,
               stack.mirror_keys, stack.mirror_values, stack.mirror_log_weights, cache.stats.key_sum]
    # bit patterns: unused pool slots come from torch.empty and may hold NaN (NaN != NaN)
    return [t.clone().view(torch.int32) if t.is_floating_point() else t.clone() for t in tensors] + [
        [layer.resident for layer in cache.layers], len(cache.operation_log)]


def same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("pairs, threshold, message", [
    ([(0, 1), (1, 0)], None, "pinned"),  # the sink
    ([(0, 1), (2, 6)], None, "pinned"),  # the newest block
    ([(0, 1), (1, 2), (0, 1)], None, "listed twice"),
    ([(0, 1), (3, 1)], None, "out of range"),
    ([(0, 1), (1, 2)], 0.999, "reaches similarity 0.999"),  # checked after the similarities: still nothing changed
])
def test_a_refused_batch_changes_nothing(pairs, threshold, message):
    cache = synthetic()
    before = snapshot(cache)
    with pytest.raises(CacheOperationError, match=message):
        cache.merge_blocks(pairs, min_similarity=threshold)
    assert same(before, snapshot(cache))
    assert cache.merge_blocks([(0, 1)], min_similarity=-1.0) == [BS * KV_HEADS]  # and it still works


def test_merge_refuses_when_no_device_block_would_be_left():
    config = SimpleNamespace(num_hidden_layers=1, max_position_embeddings=512)
    cache = PagedKVCache(config, CacheConfig(block_size=BS, sink_blocks=1))
    cache.update(torch.randn(1, KV_HEADS, 40, DIM), torch.randn(1, KV_HEADS, 40, DIM), 0)  # blocks 0, 1, 2
    with pytest.raises(CacheOperationError, match="no other device block"):
        cache.check_merge(0, 1, others=[0, 2])  # as if the other two were in the batch already
    cache.merge(0, 1)  # with the sink and the newest block left, it merges


def test_mirror_after_removals_holds_exactly_the_resident_tokens():
    cache = synthetic(tokens=130)  # blocks 0..8
    for layer, block in ((0, 2), (0, 5), (1, 1), (2, 7)):
        cache.evict(layer, block)
    cache.merge_blocks([(0, 3), (1, 6), (2, 1)])
    cache.evict(1, 4)
    for layer in range(3):
        assert_tokens_close(mirror_tokens(cache, layer), pool_tokens(cache, layer), atol=0.0)
        state = cache.layers[layer]
        positions = state.mirror_positions[: state.resident]
        assert torch.equal(state.mirror_blocks[: state.resident], positions // BS + layer * cache.max_blocks)
        keys = state.mirror_keys[0, :, : state.norms_synced]
        norms = state.mirror_norms[:, : state.norms_synced]
        assert torch.allclose(norms, 1 / keys.norm(dim=-1), rtol=1e-5)
        # block-aligned: each run of BS slots holds one block, and the newest (partial) block comes last
        blocks = state.mirror_blocks[: state.resident]
        full = state.resident // BS * BS
        assert (blocks[:full].view(-1, BS) == blocks[:full:BS, None]).all()
        assert (blocks[full:] == layer * cache.max_blocks + cache.num_logical_blocks(layer) - 1).all()
        assert blocks[-1] == layer * cache.max_blocks + cache.num_logical_blocks(layer) - 1
    # the compaction moved tail tokens into the holes: the mirror is no longer in logical order (so the checks
    # above did exercise it), which attention does not depend on
    positions = cache.layers[0].mirror_positions[: cache.layers[0].resident]
    assert not torch.equal(positions, positions.sort().values)


@torch.no_grad()
def test_decode_after_removals_matches_a_reference_missing_the_same_tokens(tiny_model):
    """Evictions (mirror compaction) then decode: the same logits as a DynamicCache-like reference built from
    the kept tokens in logical order, and the same as a cache whose mirrors are rebuilt from the pool."""
    ids = torch.randint(2, 256, (1, 100), generator=torch.Generator().manual_seed(5))
    compacted = PagedKVCache(tiny_model.config, CacheConfig())
    rebuilt = PagedKVCache(tiny_model.config, CacheConfig())
    for cache in (compacted, rebuilt):
        tiny_model(input_ids=ids, cache=cache, use_cache=True)
        for layer, block in ((0, 1), (0, 4), (1, 2), (1, 3)):
            cache.evict(layer, block)
    for layer in rebuilt.layers:
        layer.mirror_stale = True  # the old path: a full rebuild in logical order
    token = 7
    for _ in range(20):
        a = tiny_model(input_ids=torch.tensor([[token]]), cache=compacted, use_cache=True).logits[0, -1]
        b = tiny_model(input_ids=torch.tensor([[token]]), cache=rebuilt, use_cache=True).logits[0, -1]
        assert (a - b).abs().max().item() < 1e-5
        token = int(a.argmax())
        assert token == int(b.argmax())


def decisions_from(spec):
    return [Decision(layer, block, op) for layer, block, op in spec]


# per layer: merges and evictions interleaved, never two merges in a row of one layer (so the batched
# application must equal the one-by-one one exactly)
MIXED = [(0, 1, Op.MERGE), (1, 2, Op.EVICT), (1, 3, Op.MERGE), (0, 2, Op.EVICT), (0, 4, Op.MERGE),
         (1, 5, Op.EVICT), (0, 3, Op.KEEP), (1, 1, Op.MERGE), (0, 5, Op.EVICT), (1, 4, Op.PREFETCH)]


@torch.no_grad()
def test_apply_decisions_batched_equals_one_by_one(tiny_model):
    ids = torch.randint(2, 256, (1, 110), generator=torch.Generator().manual_seed(9))
    caches = []
    for _ in range(2):
        cache = PagedKVCache(tiny_model.config, CacheConfig(host_blocks=4))
        tiny_model(input_ids=ids, cache=cache, use_cache=True)
        caches.append(cache)
    batched, single = caches
    decisions = decisions_from(MIXED[:-1] + [(1, 2, Op.PREFETCH)])
    batches = []
    merge_blocks = batched.merge_blocks
    batched.merge_blocks = lambda pairs: batches.append(list(pairs)) or merge_blocks(pairs)
    counts = apply_decisions(batched, decisions)
    # each layer's evictions go first where they lead, so the merges of both layers meet in two batches
    assert batches == [[(0, 1), (1, 3)], [(0, 4), (1, 1)]]
    expected = {name: 0 for name in ("keep", "evict", "merge", "prefetch")}
    for decision in decisions:
        for name, count in apply_decisions(single, [decision]).items():
            expected[name] += count
    assert counts == expected == {"keep": 1, "evict": 4, "merge": 4, "prefetch": 1}
    assert torch.equal(batched.tables.tier, single.tables.tier)
    for layer in range(2):
        assert_tokens_close(pool_tokens(batched, layer), pool_tokens(single, layer), atol=1e-6)
    token = 3
    for _ in range(5):
        a = tiny_model(input_ids=torch.tensor([[token]]), cache=batched, use_cache=True).logits[0, -1]
        b = tiny_model(input_ids=torch.tensor([[token]]), cache=single, use_cache=True).logits[0, -1]
        assert (a - b).abs().max().item() < 1e-5
        token = int(a.argmax())


@torch.no_grad()
def test_apply_decisions_refusal_applies_exactly_what_comes_before(tiny_model):
    ids = torch.randint(2, 256, (1, 110), generator=torch.Generator().manual_seed(9))
    caches = []
    for _ in range(2):
        cache = PagedKVCache(tiny_model.config, CacheConfig(host_blocks=4))
        tiny_model(input_ids=ids, cache=cache, use_cache=True)
        caches.append(cache)
    batched, single = caches
    # the 4th decision merges a block evicted by the 2nd: refused; a later merge of layer 0 must not happen
    spec = [(0, 1, Op.MERGE), (1, 2, Op.EVICT), (1, 3, Op.MERGE), (1, 2, Op.MERGE), (0, 4, Op.MERGE)]
    with pytest.raises(CacheOperationError, match="not on the device"):
        apply_decisions(batched, decisions_from(spec))
    with pytest.raises(CacheOperationError, match="not on the device"):
        for decision in decisions_from(spec):
            apply_decisions(single, [decision])
    assert torch.equal(batched.tables.tier, single.tables.tier)
    assert batched.tables.tier[0, 4] == Tier.DEVICE and batched.tables.tier[1, 3] == Tier.DROPPED
    for layer in range(2):
        assert_tokens_close(pool_tokens(batched, layer), pool_tokens(single, layer), atol=1e-6)


def test_block_sums_of_the_aligned_mirror_equal_a_token_level_index_add():
    """The attention statistics sum per-token masses per block with a reshape (the mirror is block-aligned);
    after evictions and merges (compactions) that equals an index_add over each slot's block id."""
    cache = synthetic(tokens=130)
    for layer, block in ((0, 2), (0, 5), (1, 1), (2, 7)):
        cache.evict(layer, block)
    cache.merge_blocks([(0, 3), (1, 6), (2, 1), (2, 4)])
    cache._sync_mirrors()
    generator = torch.Generator().manual_seed(4)
    values = [torch.rand(5, cache.layers[layer].resident, generator=generator) for layer in range(3)]
    index, sums = cache._mirror_block_sums([0, 1, 2], values)
    expected = torch.zeros(5, 3 * cache.max_blocks)
    for layer, value in enumerate(values):
        expected.index_add_(1, cache.layers[layer].mirror_blocks[: value.shape[-1]], value)
    actual = torch.zeros_like(expected).index_add_(1, index, sums)
    assert torch.allclose(actual, expected, atol=1e-6)
    assert index.unique().numel() == index.numel()  # one group per block
    # negative control: a misaligned mirror (two slots swapped across blocks) no longer matches
    blocks = cache.layers[0].mirror_blocks
    blocks[[0, 20]] = blocks[[20, 0]]
    swapped = torch.zeros_like(expected)
    for layer, value in enumerate(values):
        swapped.index_add_(1, cache.layers[layer].mirror_blocks[: value.shape[-1]], value)
    index, sums = cache._mirror_block_sums([0, 1, 2], values)
    assert not torch.allclose(torch.zeros_like(swapped).index_add_(1, index, sums), swapped, atol=1e-6)


@torch.no_grad()
def test_a_closed_cache_storage_is_reused_clean_by_the_next_cache(tiny_model):
    ids = torch.randint(2, 256, (1, 90), generator=torch.Generator().manual_seed(2))
    first = PagedKVCache(tiny_model.config, CacheConfig(max_tokens=128))
    tiny_model(input_ids=ids, cache=first, use_cache=True)
    first.merge_blocks([(0, 2), (1, 3)])  # leaves non-zero log weights in the storage
    storage = first._stacks[0].pool_keys.data_ptr()
    first.close()
    reused = PagedKVCache(tiny_model.config, CacheConfig(max_tokens=128))
    out = tiny_model(input_ids=ids, cache=reused, use_cache=True).logits[0, -1]
    assert reused._stacks[0].pool_keys.data_ptr() == storage  # the same memory, taken back
    fresh = PagedKVCache(tiny_model.config, CacheConfig(max_tokens=128))  # the pool is empty now: new memory
    expected = tiny_model(input_ids=ids, cache=fresh, use_cache=True).logits[0, -1]
    assert fresh._stacks[0].pool_keys.data_ptr() != storage
    assert torch.equal(out, expected)
    for cache in (reused, fresh):
        assert not cache.device_pool(0).has_merged and cache._stacks[0].mirror_log_weights.abs().max() == 0
        cache.merge_blocks([(0, 2)])
    token = int(out.argmax())
    for _ in range(3):  # merged caches decode alike: no stale log weight survived the reuse
        a = tiny_model(input_ids=torch.tensor([[token]]), cache=reused, use_cache=True).logits[0, -1]
        b = tiny_model(input_ids=torch.tensor([[token]]), cache=fresh, use_cache=True).logits[0, -1]
        assert torch.equal(a, b)
        token = int(a.argmax())
