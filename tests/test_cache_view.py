"""The controller's view, and the budget invariant under random operation sequences (hypothesis)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache.controller import CacheView, Decision, Op, apply_decisions
from cache.paged_cache import CacheConfig, CacheOperationError, PagedKVCache
from cache.sentences import is_sentence_end, sentence_end_token_ids
from cache.tiers import Tier


@torch.no_grad()
def filled(model, tokens=100, **config):
    cache = PagedKVCache(model.config, CacheConfig(**config))
    ids = torch.randint(2, 256, (1, tokens), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def test_view_fields_describe_the_cache(tiny_model):
    cache = filled(tiny_model, host_blocks=2, disk_blocks=1)  # 100 tokens: blocks 0..6
    ends = torch.zeros(100, dtype=torch.bool)
    ends[[20, 21, 70]] = True  # two sentence ends in block 1, one in block 4
    cache.observe_tokens(0, ends)
    cache.evict(0, 2)  # host
    cache.evict(0, 3)  # host
    cache.evict(0, 4)  # disk
    cache.evict(0, 5)  # dropped
    view = CacheView.from_cache(cache, [4, 5])
    assert view.tier[0].tolist() == [Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.HOST, Tier.DISK, Tier.DROPPED,
                                     Tier.DEVICE]
    assert view.first_position.tolist() == [0, 16, 32, 48, 64, 80, 96]
    assert view.num_tokens[1].tolist() == [16] * 6 + [4]
    assert view.pinned[0].tolist() == [True] + [False] * 5 + [True]
    assert view.sentence_boundary.tolist() == [False, True, False, False, True, False, False]
    assert view.sentence_id.tolist() == [0, 0, 2, 2, 2, 3, 3]
    assert view.device_blocks().tolist() == [3, 7]
    assert torch.allclose(view.pressure, torch.tensor([3 / 4, 7 / 5]))
    device_capacity = cache.device_pool(0).num_blocks * 2
    assert torch.allclose(view.tier_occupancy, torch.tensor([10 / device_capacity, 2 / 4, 1 / 2]))
    assert view.dropped_spans(0) == [(80, 95)] and view.dropped_spans(1) == []
    legal = view.legal_ops
    assert legal[..., Op.KEEP].all()
    assert legal[0, :, Op.EVICT].tolist() == [False, True, False, False, False, False, False]
    assert legal[0, :, Op.MERGE].tolist() == legal[0, :, Op.EVICT].tolist()
    assert legal[0, :, Op.PREFETCH].tolist() == [False, False, True, True, True, False, False]
    # statistics are copies: a controller cannot change the cache through the view
    view.acc_mass.fill_(123.0)
    assert cache.stats.acc_mass.max().item() < 123.0


def test_view_similarities_against_direct_computation(tiny_model):
    cache = filled(tiny_model)
    with torch.no_grad():
        tiny_model(input_ids=torch.tensor([[9]]), cache=cache, use_cache=True)
    view = CacheView.from_cache(cache, [8, 8])
    n = view.num_blocks
    assert view.mean_key.shape == (2, n, 2, 16)
    keys, _ = cache.resident_keys_values(1)
    block3 = keys[0, :, 48:64].transpose(0, 1)  # [16, kv_heads, dim]
    assert torch.allclose(view.mean_key[1, 3], block3.mean(dim=0), atol=1e-6)
    assert torch.equal(view.key_max[1, 3], block3.amax(dim=0))
    query = cache.last_query[1].reshape(2, 2, 16).mean(dim=1)  # [kv_heads, dim]
    expected = torch.nn.functional.cosine_similarity(block3.mean(dim=0), query, dim=-1).mean()
    assert abs(view.query_similarity[1, 3].item() - expected.item()) < 1e-5
    flat = torch.nn.functional.normalize(view.mean_key[1].flatten(1), dim=-1)
    similarity = flat @ flat.T
    similarity.fill_diagonal_(-1.0)
    assert torch.allclose(view.neighbour_similarity[1], similarity.max(dim=1).values, atol=1e-6)


def test_sentence_end_tokens_come_from_the_tokenizer_punctuation(smollm2):
    tokenizer = smollm2.tokenizer
    ends = sentence_end_token_ids(tokenizer)
    ids = torch.tensor(tokenizer("It was late. Was it? Yes! Then the end").input_ids)
    marked = [tokenizer.decode([int(t)]).strip() for t in ids[is_sentence_end(ids, ends)]]
    assert marked == [".", "?", "!"]


operations = st.lists(st.tuples(st.sampled_from(list(Op) + ["step"]), st.integers(0, 1), st.integers(0, 20)),
                      min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, budget=st.integers(2, 5))
def test_budget_invariant_under_random_operations(tiny_model, ops, budget):
    """Random evict / merge / prefetch / keep decisions between decode steps: refused operations leave the
    cache unchanged, and after every decision point each layer is within budget, fallbacks counted."""
    cache = filled(tiny_model, tokens=70, host_blocks=2, disk_blocks=2)
    budgets = [budget, budget]
    fallbacks = cache.enforce_budget(budgets)
    token = 5
    for op, layer, block in ops:
        if op == "step":
            with torch.no_grad():
                tiny_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        else:
            before = (cache.tables.tier.clone(), cache.tables.physical.clone())
            legal = CacheView.from_cache(cache, budgets).legal_ops
            in_range = block < cache.num_logical_blocks(layer)
            try:
                apply_decisions(cache, [Decision(layer, block, op)])
                assert in_range and legal[layer, block, op]
            except CacheOperationError:
                assert not (in_range and legal[layer, block, op])
                assert torch.equal(before[0], cache.tables.tier) and torch.equal(before[1], cache.tables.physical)
        excess = sum(max(cache.tables.count_in(layer, Tier.DEVICE) - budget, 0) for layer in range(2))
        enforced = cache.enforce_budget(budgets)
        assert enforced == excess  # the fallback evicts exactly the excess, and says so
        fallbacks += enforced
        for layer in range(2):
            assert cache.tables.count_in(layer, Tier.DEVICE) <= budget
            assert cache.tables.count_in(layer, Tier.DEVICE) == int((cache.tables.tier[layer] == Tier.DEVICE).sum())
            used = cache.device_pool(layer).allocator.num_used
            assert used == cache.tables.count_in(layer, Tier.DEVICE)
    assert fallbacks >= 0
    with pytest.raises(ValueError):
        cache.enforce_budget(budgets, rule="bogus")


@torch.no_grad()
def test_sentence_query_is_the_mean_query_since_the_last_sentence_end(tiny_model):
    cache = filled(tiny_model, tokens=40)
    view = CacheView.from_cache(cache, [4, 4])
    assert view.sentence_query is None  # right after the prompt
    assert torch.equal(view.last_mass[0], cache.stats.last_mass[0, : view.num_blocks])
    queries = []
    for position, (token, ends) in enumerate([(7, False), (8, True), (9, False), (10, False)], start=40):
        cache.observe_tokens(position, torch.tensor([ends]))
        tiny_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        queries.append(cache.last_query[1].clone())
    view = CacheView.from_cache(cache, [4, 4])
    # the sentence being generated started after token 8: its queries are those of tokens 9 and 10
    assert torch.allclose(view.sentence_query[1], (queries[2] + queries[3]) / 2, atol=1e-6)
    # the decode step's mass is TOVA's score: one query's worth, spread over the blocks
    assert abs(view.last_mass[0].sum().item() - 1.0) < 1e-5


@torch.no_grad()
def test_view_reports_the_latest_forward_and_free_blocks(tiny_model):
    cache = filled(tiny_model, tokens=40)
    view = CacheView.from_cache(cache, [4, 4])
    assert (view.forward_tokens, view.forward_queries, view.sentence_length) == (40, 40, 0)
    assert view.device_free.tolist() == [cache.device_pool(0).num_blocks - 3] * 2
    tiny_model(input_ids=torch.tensor([[3]]), cache=cache, use_cache=True)
    view = CacheView.from_cache(cache, [4, 4])
    assert (view.forward_tokens, view.forward_queries, view.sentence_length) == (1, 1, 1)


def test_window_attention_share_is_the_attention_the_forward_computed_offloaded_blocks_included(tiny_model):
    cache = filled(tiny_model, tokens=100, host_blocks=4)
    view = CacheView.from_cache(cache, [8, 8])
    window = view.window_queries[0].shape[1]  # the prefill's counted queries (its last 64)
    recorded = view.last_mass_heads.transpose(1, 2) / window  # every block resident: the forward saw them all
    assert torch.allclose(view.window_attention_share, recorded, atol=1e-6)
    cache.evict(0, 2)
    cache.evict(0, 3)  # both to the host: the next forward of layer 0 does not see them
    with torch.no_grad():
        tiny_model(input_ids=torch.tensor([[9]]), cache=cache, use_cache=True)
    view = CacheView.from_cache(cache, [8, 8])
    exact, recorded = view.window_attention_share, view.last_mass_heads.transpose(1, 2)
    assert torch.allclose(exact.sum(dim=1), torch.ones(2, 4))
    assert exact[0, [2, 3]].min() > 0 and recorded[0, [2, 3]].max() == 0  # scored where they lie
    device = view.tier[0] == Tier.DEVICE  # over the resident blocks the forward's own softmax, renormalised
    assert torch.allclose(exact[0, device] / exact[0, device].sum(dim=0), recorded[0, device], atol=1e-6)
    assert torch.allclose(exact[1], recorded[1], atol=1e-6)  # layer 1 offloaded nothing
