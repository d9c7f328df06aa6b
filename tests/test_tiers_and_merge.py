"""Tiers (device / host / disk), tiered eviction and prefetch, and the merge operation."""

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from cache.attention import paged_attention_forward
from cache.paged_cache import CacheConfig, CacheOperationError, PagedKVCache
from cache.tiers import Tier

BYTES_PER_BLOCK = 2 * 16 * 2 * 16 * 4  # K+V, block_size 16, 2 KV heads, head_dim 16, fp32 (tiny model)


def ids_of(length, seed=11):
    return torch.randint(2, 256, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decode(model, cache, first_token, steps):
    tokens, logits, token = [], [], first_token
    for _ in range(steps):
        out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        token = int(logits[-1].argmax())
        tokens.append(token)
    return tokens, torch.stack(logits)


@torch.no_grad()
def test_evict_fills_host_then_disk_then_drops_and_prefetch_from_disk_is_exact(tiny_model, tmp_path):
    ids = ids_of(100)  # blocks 0..6
    cache = PagedKVCache(tiny_model.config, CacheConfig(host_blocks=1, disk_blocks=2, disk_dir=str(tmp_path)))
    first = int(tiny_model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())
    assert [cache.evict(0, b) for b in (1, 2, 3, 4)] == [Tier.HOST, Tier.DISK, Tier.DISK, Tier.DROPPED]
    assert cache.bytes_moved[("device", "host")] == BYTES_PER_BLOCK
    assert cache.bytes_moved[("device", "disk")] == 2 * BYTES_PER_BLOCK
    files = sorted(p.name for p in cache.disk_dir.iterdir())
    assert files == sorted(f"layer{i}.{part}" for i in (0, 1) for part in ("keys", "values", "weights"))
    assert cache.disk_dir.parent == tmp_path

    # the disk tier survives a reopen (unmap + map again) within the run
    cache.reopen_disk()
    for block in (3, 2, 1):
        cache.prefetch(0, block)
    assert cache.bytes_moved[("disk", "device")] == 2 * BYTES_PER_BLOCK
    assert cache.bytes_moved[("host", "device")] == BYTES_PER_BLOCK
    assert cache.blocks_per_tier()["device"] == [6, 7] and cache.blocks_per_tier()["dropped"] == [1, 0]
    with pytest.raises(CacheOperationError, match="DROPPED"):
        cache.prefetch(0, 4)  # dropped content cannot come back: a cache miss

    # with block 4 dropped on layer 0 only, decode equals a reference missing exactly that block
    keep = [[t for t in range(100) if t // 16 != 4], list(range(100))]
    reference = DynamicCache(config=tiny_model.config)
    tiny_model(input_ids=ids, cache=reference, use_cache=True)
    for layer, kept in enumerate(keep):
        reference.layers[layer].keys = reference.layers[layer].keys[:, :, kept].contiguous()
        reference.layers[layer].values = reference.layers[layer].values[:, :, kept].contiguous()
    expected, token = [], first
    for step in range(12):
        out = tiny_model(input_ids=torch.tensor([[token]]), cache=reference, use_cache=True,
                         position_ids=torch.tensor([[100 + step]]))
        expected.append(out.logits[0, -1])
        token = int(expected[-1].argmax())
    tokens, logits = decode(tiny_model, cache, first, 12)
    assert (logits - torch.stack(expected)).abs().max().item() < 1e-4
    assert len(tokens) == 12

    disk_dir = cache.disk_dir
    cache.close()
    assert not disk_dir.exists()


@torch.no_grad()
def test_offload_to_disk_and_back_is_bit_exact(tiny_model):
    ids = ids_of(90)
    reference = DynamicCache(config=tiny_model.config)
    first = int(tiny_model(input_ids=ids, cache=reference, use_cache=True).logits[0, -1].argmax())
    ref_tokens, ref_logits = decode(tiny_model, reference, first, 15)
    cache = PagedKVCache(tiny_model.config, CacheConfig(disk_blocks=8))
    tiny_model(input_ids=ids, cache=cache, use_cache=True)
    for layer in (0, 1):
        for block in (1, 2, 3):
            assert cache.evict(layer, block) == Tier.DISK
        for block in (2, 3, 1):
            cache.prefetch(layer, block)
    tokens, logits = decode(tiny_model, cache, first, 15)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4
    disk_dir = cache.disk_dir
    assert disk_dir.exists()
    cache.close()
    assert not disk_dir.exists()


def attention_output(cache, layer, query):
    module = SimpleNamespace(layer_idx=layer, num_key_value_groups=2, is_causal=True)
    key, value = cache.resident_keys_values(layer)
    output, _ = paged_attention_forward(module, query, key, value, None, scaling=0.25, paged_cache=cache)
    return output


def synthetic_cache(duplicate_keys: bool):
    """One layer, 2 KV heads, head_dim 16, 4 blocks of 16 tokens written directly through ``update``.
    With ``duplicate_keys``, block 1's keys equal block 2's (values differ)."""
    config = SimpleNamespace(num_hidden_layers=1, max_position_embeddings=256)
    cache = PagedKVCache(config, CacheConfig(block_size=16))
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 64, 16, generator=generator)
    values = torch.randn(1, 2, 64, 16, generator=generator)
    if duplicate_keys:
        keys[:, :, 16:32] = keys[:, :, 32:48]
    cache.update(keys, values, 0)
    return cache, keys, values


def test_merge_of_duplicate_keys_is_exact_under_proportional_attention():
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    cache, _, _ = synthetic_cache(duplicate_keys=True)
    before = attention_output(cache, 0, query)
    folded = cache.merge(0, 1)
    assert folded == 16 * 2  # every token, for each of the 2 KV heads
    assert cache.tables.tier[0, :4].tolist() == [Tier.DEVICE, Tier.DROPPED, Tier.DEVICE, Tier.DEVICE]
    assert cache.resident_tokens(0) == 48
    after = attention_output(cache, 0, query)
    assert (after - before).abs().max().item() < 1e-5
    assert cache.operation_log[-1]["op"] == "merge"
    # negative control: the same merged keys/values without the log-count bias are not exact
    cache.device_pool(0).has_merged = False
    without_bias = attention_output(cache, 0, query)
    assert (without_bias - before).abs().max().item() > 1e-3


def test_merge_conserves_token_counts_in_log_weights():
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(2))
    full, _, _ = synthetic_cache(duplicate_keys=False)
    merged, _, _ = synthetic_cache(duplicate_keys=False)
    evicted, _, _ = synthetic_cache(duplicate_keys=False)
    exact = attention_output(full, 0, query)
    merged.merge(0, 1)
    evicted.evict(0, 1)
    # each kept slot stands for exp(log_weight) tokens: the totals are conserved
    weights = merged.device_pool(0).log_weights.exp()
    resident_physical = merged.tables.physical[0, [0, 2, 3]]
    assert torch.allclose(weights[resident_physical].sum(dim=(0, 1)), torch.tensor([64.0, 64.0]))
    assert merged.resident_tokens(0) == evicted.resident_tokens(0) == 48
    assert attention_output(merged, 0, query).shape == exact.shape


def test_merge_refusals_leave_the_cache_unchanged():
    cache, _, _ = synthetic_cache(duplicate_keys=False)
    before = (cache.tables.tier.clone(), cache.device_pool(0).keys.clone())
    with pytest.raises(CacheOperationError, match="pinned"):
        cache.merge(0, 0)
    with pytest.raises(CacheOperationError, match="pinned"):
        cache.merge(0, 3)  # the newest block
    with pytest.raises(CacheOperationError, match="reaches similarity 0.999"):
        cache.merge(0, 1, min_similarity=0.999)
    # bit for bit: the pool is allocated with torch.empty, so unused slots may hold NaN patterns, which a
    # value comparison (NaN != NaN) would report as changed
    keys = cache.device_pool(0).keys
    assert torch.equal(before[0], cache.tables.tier) and torch.equal(before[1].view(torch.int32), keys.view(torch.int32))
    cache.evict(0, 1)
    with pytest.raises(CacheOperationError, match="not on the device"):
        cache.merge(0, 1)


def test_config_rejects_negative_capacities():
    with pytest.raises(ValueError, match="disk_blocks must be >= 0"):
        CacheConfig(disk_blocks=-1)
