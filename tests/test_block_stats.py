"""Block statistics collected inside the paged attention function, against eager attention weights."""

import torch
from transformers import DynamicCache

from cache.attention import PAGED_ATTENTION
from cache.paged_cache import CacheConfig, PagedKVCache
from tests.conftest import make_tiny_llama

BLOCK = 16


@torch.no_grad()
def reference_block_mass(ids, decode_tokens, window):
    """Per-layer, per-block attention mass from eager attention weights (``output_attentions``), averaged
    over query heads, summed over the last ``window`` prompt queries and every decode query."""
    model = make_tiny_llama()
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, output_attentions=True)
    total = ids.shape[1] + len(decode_tokens)
    n_blocks = -(-total // BLOCK)
    mass = torch.zeros(2, n_blocks)
    block_of = torch.arange(total) // BLOCK

    def add(attentions, rows):
        for layer, weights in enumerate(attentions):  # [1, heads, q, kv]
            token_mass = weights[0, :, rows].mean(dim=0).sum(dim=0)
            mass[layer].index_add_(0, block_of[: token_mass.numel()], token_mass)

    add(out.attentions, slice(-window, None))
    for token in decode_tokens:
        out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, output_attentions=True)
        add(out.attentions, slice(None))
    model.set_attn_implementation(PAGED_ATTENTION)
    return mass, cache


@torch.no_grad()
def test_attention_mass_matches_eager_weights(tiny_model):
    ids = torch.randint(2, 256, (1, 70), generator=torch.Generator().manual_seed(3))
    decode_tokens = [5, 9, 13, 200, 7, 8, 40, 41, 42, 90, 91, 92]  # crosses a block boundary at 80
    window = 24
    cache = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK, stats_window=window))
    tiny_model(input_ids=ids, cache=cache, use_cache=True)
    for token in decode_tokens:
        tiny_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
    expected, reference_cache = reference_block_mass(ids, decode_tokens, window)
    n = expected.shape[1]
    got = cache.stats.acc_mass[:, :n]
    assert torch.allclose(got, expected, atol=1e-5)
    # each query hands out a total mass of one
    assert torch.allclose(got.sum(dim=1), torch.full((2,), float(window + len(decode_tokens))), atol=1e-4)
    # mean key per block equals the mean of the post-RoPE keys DynamicCache holds
    keys = reference_cache.layers[0].keys[0].transpose(0, 1)  # [tokens, kv_heads, dim]
    cache.refresh_key_stats()  # the newest, partially filled block is summarised on demand
    mean_key = cache.stats.mean_key(cache.tables.num_tokens)[0]
    for block in range(n):
        assert torch.allclose(mean_key[block], keys[block * BLOCK : (block + 1) * BLOCK].mean(dim=0), atol=1e-5)
        assert torch.equal(cache.stats.key_max[0, block], keys[block * BLOCK : (block + 1) * BLOCK].amax(dim=0))
        assert torch.equal(cache.stats.key_min[0, block], keys[block * BLOCK : (block + 1) * BLOCK].amin(dim=0))


@torch.no_grad()
def test_recent_mass_decays_and_last_attended_tracks_seen(tiny_model):
    cache = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK, recent_decay=0.5))
    ids = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    tiny_model(input_ids=ids, cache=cache, use_cache=True)
    before = cache.stats.recent_mass[0, :3].clone()
    tiny_model(input_ids=torch.tensor([[3]]), cache=cache, use_cache=True)
    acc_step = cache.stats.acc_mass[0, :3] - 0  # includes prefill
    step_mass = cache.stats.recent_mass[0, :3] - 0.5 * before
    assert torch.all(step_mass > 0)
    assert abs(step_mass.sum().item() - 1.0) < 1e-5  # one decode query
    assert torch.all(acc_step >= step_mass)
    # a block counts as attended when it gets at least the uniform share (1/3 here); some block always does
    attended = cache.stats.last_attended[0, :3]
    assert (attended == 41).any()
    assert torch.all((attended == 41) == (step_mass >= 1 / 3 - 1e-7))


@torch.no_grad()
def test_bytes_read_per_attention_call(tiny_model):
    cache = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK))
    ids = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    tiny_model(input_ids=ids, cache=cache, use_cache=True)
    per_token = 2 * 2 * 16 * 4  # K+V, 2 KV heads, head_dim 16, fp32
    assert cache.bytes_per_token == per_token
    assert cache.last_bytes_read == [40 * per_token] * 2
    for step in range(3):
        tiny_model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True)
        assert cache.last_bytes_read == [(41 + step) * per_token] * 2
    cache.evict(0, 1)
    tiny_model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True)
    assert cache.last_bytes_read == [(44 - 16) * per_token, 44 * per_token]
    assert cache.bytes_read[1] == (40 + 41 + 42 + 43 + 44) * per_token
    assert cache.attention_calls == [5, 5]


@torch.no_grad()
def eager_attentions(ids):
    model = make_tiny_llama()
    model.set_attn_implementation("eager")
    out = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True, output_attentions=True)
    return [weights[0] for weights in out.attentions]  # per layer [heads, q, kv]


@torch.no_grad()
def test_per_head_last_query_max_and_observer_statistics_match_eager_weights(tiny_model):
    """Per-head mass (and its max over heads), the last query's mass (TOVA), the per-query max (KVzip) and
    the observer counts (ObservedAttention) against eager attention weights; the negative control: the last
    query's mass is not the window's."""
    from cache.controller import CacheView

    ids = torch.randint(2, 256, (1, 56), generator=torch.Generator().manual_seed(7))
    window = 20
    cache = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK, stats_window=window, track_query_max=True))
    tiny_model(input_ids=ids, cache=cache, use_cache=True)
    view = CacheView.from_cache(cache, [4, 4])
    n = view.num_blocks
    block_of = torch.arange(56) // BLOCK
    for layer, weights in enumerate(eager_attentions(ids)):
        rows = weights[:, -window:]  # [heads, window, kv]
        per_query_block = torch.zeros(rows.shape[0], window, n).index_add_(2, block_of, rows)
        per_head = per_query_block.sum(dim=1)
        assert torch.allclose(view.acc_mass_heads[layer], per_head, atol=1e-5)
        assert torch.allclose(view.mass("acc", "max")[layer], per_head.amax(dim=0), atol=1e-5)
        assert torch.allclose(view.mass("acc", "mean")[layer], view.acc_mass[layer], atol=1e-6)
        last = per_query_block[:, -1]
        assert torch.allclose(view.mass("last_query", "mean")[layer], last.mean(dim=0), atol=1e-5)
        assert not torch.allclose(view.mass("last_query", "mean")[layer], per_head.mean(dim=0), atol=1e-3)
        assert torch.allclose(view.mass("query_max", "max")[layer], per_query_block.amax(dim=(0, 1)), atol=1e-5)
    # token t is seen by the window queries at positions >= t: min(window, 56 - t) of them
    counts = torch.clamp(56 - torch.arange(56), max=window).float()
    expected = torch.zeros(n).index_add_(0, block_of, counts)
    assert torch.allclose(cache.stats.observers[0, :n], expected)
    assert torch.allclose(view.observed_mass[0], view.acc_mass[0] / (expected / view.num_tokens[0]).clamp(min=1))
    assert view.window_queries[0].shape == (4, window, 16)


@torch.no_grad()
def test_refresh_key_stats_follows_decode_in_every_layer_and_in_clones(tiny_model):
    """Only layers that decoded since their last summary are refreshed: a second round of decode steps, in the
    cache and in a clone, still leaves every layer's newest block summarised from its current keys."""
    cache = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK))
    tiny_model(input_ids=torch.randint(2, 256, (1, 37), generator=torch.Generator().manual_seed(5)), cache=cache,
               use_cache=True)

    def newest_block_matches(c: PagedKVCache) -> bool:
        c.refresh_key_stats()
        n = c.tables.num_logical(0)
        count = int(c.tables.num_tokens[0, n - 1])
        ok = True
        for layer in range(c.num_layers):
            keys = c.device_pool(layer).keys[c.tables.physical[layer, n - 1], :count]  # [count, kv, dim]
            ok &= torch.equal(c.stats.key_max[layer, n - 1], keys.amax(dim=0))
            ok &= torch.allclose(c.stats.key_sum[layer, n - 1], keys.sum(dim=0), atol=1e-5)
        return bool(ok)

    for token in (5, 6):
        tiny_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
    assert newest_block_matches(cache)
    assert not cache.key_stats_stale  # refreshed: nothing left to do until the next decode step
    tiny_model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True)
    copy = cache.clone()
    for c in (cache, copy):
        tiny_model(input_ids=torch.tensor([[8]]), cache=c, use_cache=True)
        assert newest_block_matches(c)
    # negative control: a decode step whose layer is not marked stale leaves the newest summary behind
    tiny_model(input_ids=torch.tensor([[9]]), cache=cache, use_cache=True)
    cache.key_stats_stale.clear()
    assert not newest_block_matches(cache)
