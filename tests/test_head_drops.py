"""Per-KV-head drops (``PagedKVCache.drop_head``, kvpress's per-head pruning by masking) on the tiny random Llama:
the attention matches eager attention with the same (head, keys) masked, the budget counts head shares, a block
goes with its last head and comes back whole, and KVzip's per-head selection keeps every budget."""

import pytest
import torch
from transformers import DynamicCache

from agents.baselines import kvzip as kvzip_module
from agents.baselines.kvzip import KVzip
from cache.attention import PAGED_ATTENTION
from cache.controller import CacheView, Decision, Op, apply_decisions
from cache.paged_cache import CacheConfig, CacheOperationError, PagedKVCache
from cache.runner import Prompt, Runner
from cache.tiers import Tier

BLOCK = 8
IDS = torch.randint(2, 256, (1, 100), generator=torch.Generator().manual_seed(3))
NEXT = torch.tensor([[7]])


def prefilled(model, **config):
    cache = PagedKVCache(model.config, CacheConfig(block_size=BLOCK, **config))
    with torch.no_grad():
        model(input_ids=IDS, cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def eager_logits(model, masked):
    """The reference: transformers' eager attention over a ``DynamicCache`` of the same prompt, the next token's
    queries of the heads of each masked (KV head, block) pair given -inf on that block's keys, in every layer."""
    heads = model.config.num_attention_heads
    group = heads // model.config.num_key_value_heads
    mask = torch.zeros(1, heads, 1, IDS.shape[1] + 1)
    for kv_head, block in masked:
        mask[0, kv_head * group : (kv_head + 1) * group, 0, block * BLOCK : (block + 1) * BLOCK] = float("-inf")
    model.set_attn_implementation("eager")
    try:
        cache = DynamicCache()
        model(input_ids=IDS, past_key_values=cache, use_cache=True)
        return model(input_ids=NEXT, past_key_values=cache, attention_mask=mask,
                     position_ids=torch.tensor([[IDS.shape[1]]])).logits[0, -1]
    finally:
        model.set_attn_implementation(PAGED_ATTENTION)


def test_a_dropped_head_attends_as_eager_attention_with_its_keys_masked(tiny_model):
    cache = prefilled(tiny_model)
    for layer in range(cache.num_layers):
        cache.drop_head(layer, 3, 1)
        cache.drop_head(layer, 5, 0)
    with torch.no_grad():
        paged = tiny_model(input_ids=NEXT, cache=cache, use_cache=True).logits[0, -1]
    assert torch.allclose(paged, eager_logits(tiny_model, [(1, 3), (0, 5)]), atol=1e-5)
    wrong = eager_logits(tiny_model, [(0, 3), (1, 5)])  # negative control: the other heads masked
    assert (paged - wrong).abs().max() > 1e-3


def test_the_budget_counts_head_shares_and_a_block_goes_with_its_last_head(tiny_model):
    cache = prefilled(tiny_model, host_blocks=8)
    blocks = cache.tables.count_in(0, Tier.DEVICE)
    assert cache.drop_head(0, 4, 0) == Tier.DEVICE
    assert cache.device_load(0) == blocks - 0.5 and cache.device_load(1) == blocks
    with pytest.raises(CacheOperationError, match="already dropped"):
        cache.drop_head(0, 4, 0)
    with pytest.raises(CacheOperationError, match="out of range"):
        cache.drop_head(0, 4, 2)
    with pytest.raises(CacheOperationError, match="pinned"):
        cache.drop_head(0, 0, 1)
    assert cache.drop_head(0, 4, 1) == Tier.HOST  # the last head: evicted, its device memory freed
    assert cache.tables.count_in(0, Tier.DEVICE) == blocks - 1 and cache.device_load(0) == blocks - 1
    cache.prefetch(0, 4)  # back whole: every head attends it again, as in the full cache
    with torch.no_grad():
        logits = tiny_model(input_ids=NEXT, cache=cache, use_cache=True).logits[0, -1]
        full = prefilled(tiny_model)
        reference = tiny_model(input_ids=NEXT, cache=full, use_cache=True).logits[0, -1]
    assert torch.allclose(logits, reference, atol=1e-5)


def test_head_decisions_apply_in_order_and_a_repeated_head_is_refused(tiny_model):
    cache = prefilled(tiny_model)
    apply_decisions(cache, [Decision(1, 6, Op.EVICT, 0), Decision(1, 7, Op.EVICT)])
    assert bool(cache.head_dropped[1, 0, 6]) and cache.tables.tier[1, 7] == Tier.DROPPED
    with pytest.raises(CacheOperationError, match="already dropped"):
        apply_decisions(cache, [Decision(1, 8, Op.EVICT, 1), Decision(1, 6, Op.EVICT, 0)])
    assert bool(cache.head_dropped[1, 1, 8])  # what came before the refused decision is applied


def test_kvzip_per_head_keeps_each_heads_best_blocks_within_the_budget(tiny_model, monkeypatch):
    """Head 0's reconstruction needs block 4, head 1's block 6: per head (kvpress's rule) each keeps its own; with
    one block set per layer (per_head=false, the negative control) one of the two is lost."""
    heads = tiny_model.config.num_attention_heads
    mass = torch.full((2, heads, 13), 0.1)
    mass[:, : heads // 2, 4] = 0.9  # KV head 0's query heads
    mass[:, heads // 2 :, 6] = 0.8  # KV head 1's
    monkeypatch.setattr(kvzip_module, "reconstruction_mass", lambda view, chunk_size: mass)
    kvzip_module.forget_reconstructions()
    cache = prefilled(tiny_model)
    view = CacheView.from_cache(cache, [3, 3], phase="compress", model=tiny_model, token_ids=IDS[0], total_budget=6)
    apply_decisions(cache, KVzip().decide(view))
    for layer in range(2):
        on_device = (cache.tables.tier[layer, :13] == Tier.DEVICE).nonzero().flatten().tolist()
        assert on_device == [0, 4, 6, 12]  # the sink, each head's block, the newest
        assert bool(cache.head_dropped[layer, 1, 4]) and bool(cache.head_dropped[layer, 0, 6])
        assert cache.device_load(layer) == 3.0
    shared = prefilled(tiny_model)
    view = CacheView.from_cache(shared, [3, 3], phase="compress", model=tiny_model, token_ids=IDS[0], total_budget=6)
    apply_decisions(shared, KVzip(per_head=False).decide(view))
    assert (shared.tables.tier[0, :13] == Tier.DEVICE).nonzero().flatten().tolist() == [0, 4, 12]


@pytest.mark.parametrize("spec", [{}, {"layerwise": True}])
def test_kvzip_per_head_runs_without_fallbacks(tiny_model, spec):
    kvzip_module.forget_reconstructions()
    ids = torch.randint(2, 256, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    runner = Runner(tiny_model, cache_config=CacheConfig(block_size=BLOCK), controller=KVzip(**spec), budget=0.3,
                    protocol="oneshot-question")
    result = runner.run(Prompt(ids, context_end=140), max_new_tokens=4, stop_at_eos=False)
    assert result.fallbacks == 0 and result.operations.get("evict", 0) > 0
