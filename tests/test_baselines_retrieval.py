"""SentenceKV and Quest: query-aware retrieval through the host tier, on constructed views of a real cache."""

import pytest
import torch

from agents.baselines.quest import Quest
from agents.baselines.sentencekv import SentenceKV
from cache.controller import CacheView, Op, apply_decisions, page_bounds
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.runner import Runner
from cache.tiers import Tier
from tests.test_baselines_common import Checked

DIM, KV_HEADS, HEADS = 16, 2, 4  # the tiny model


@torch.no_grad()
def filled(model, prompt=160, decode_steps=0, host_blocks=32, host_evicted=(), sentence_ends=()):
    """A cache after ``prompt`` tokens and ``decode_steps`` single-token steps, with blocks ``host_evicted`` of
    both layers moved to the host tier and sentences ending at the given positions."""
    cache = PagedKVCache(model.config, CacheConfig(host_blocks=host_blocks))
    model(input_ids=torch.randint(2, 256, (1, prompt), generator=torch.Generator().manual_seed(1)), cache=cache,
          use_cache=True)
    for _ in range(decode_steps):
        model(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)
    ends = torch.zeros(cache.seen, dtype=torch.bool)
    ends[list(sentence_ends)] = True
    cache.observe_tokens(0, ends)
    for layer in range(cache.num_layers):
        for block in host_evicted:
            cache.evict(layer, block)
    return cache


def basis(index, scale=1.0):
    vector = torch.zeros(DIM)
    vector[index] = scale
    return vector


def ops(decisions, op, layer=0):
    return [d.block for d in decisions if d.layer == layer and d.op == op]


def device_set(cache, layer=0):
    return torch.nonzero(cache.tables.tier[layer, : cache.num_logical_blocks()] == Tier.DEVICE).flatten().tolist()


def one_hot_mass(view, masses: dict[int, float]):
    """A decode step's ``last_mass`` (sums to one query) with the given per-block shares."""
    mass = torch.zeros(view.num_layers, view.num_blocks)
    for block, value in masses.items():
        mass[:, block] = value
    return mass / mass.sum(dim=1, keepdim=True)


# ------------------------------------------------------------------------------------------------- SentenceKV
def test_sentencekv_retrieves_the_best_matching_sentence_from_the_host(tiny_model):
    # 158 prompt tokens + 2 decode steps: blocks 0..9, all full; sentences {0,1} {2,3} {4,5} {6,7} {8,9}
    cache = filled(tiny_model, prompt=158, decode_steps=2, host_evicted=(4, 5, 6), sentence_ends=(31, 63, 95, 127))
    view = CacheView.from_cache(cache, [6, 6], phase="decode")
    assert view.sentence_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert view.device_blocks().tolist() == [7, 7]  # 0 1 2 3 7 8 9; budget 6
    keys = basis(1).expand(2, 10, KV_HEADS, DIM).clone()
    keys[0, 4:6] = basis(0)  # layer 0: sentence 2 (on the host) matches the query
    keys[0, 6:8] = basis(0, 0.5)
    keys[1, 4:6] = basis(0)  # layer 1: sentence 3's larger dot product wins although its cosine is lower
    keys[1, 6:8] = basis(0, 3.0) + basis(1, 10.0)
    view.mean_key = keys
    view.sentence_query = basis(0).expand(2, HEADS, DIM).clone()
    decisions = SentenceKV().decide(view)
    # sink (first 32 tokens: blocks 0, 1) and recent (last 32: blocks 8, 9) stay; 2 blocks left for retrieval
    assert ops(decisions, Op.PREFETCH) == [4, 5] and ops(decisions, Op.EVICT) == [2, 3, 7]
    assert ops(decisions, Op.PREFETCH, layer=1) == [6] and ops(decisions, Op.EVICT, layer=1) == [2, 3]
    apply_decisions(cache, decisions)
    assert device_set(cache) == [0, 1, 4, 5, 8, 9] and device_set(cache, 1) == [0, 1, 6, 7, 8, 9]
    assert cache.tables.tier[0, [2, 3, 6, 7]].tolist() == [Tier.HOST] * 4  # offloaded, not dropped


def test_sentencekv_without_sentences_ranks_blocks_and_weights_queries_per_head(tiny_model):
    cache = filled(tiny_model, prompt=158, decode_steps=2, host_evicted=(4, 5, 6))  # no sentence ends
    view = CacheView.from_cache(cache, [6, 6], phase="decode")
    keys = torch.zeros(2, 10, KV_HEADS, DIM)
    keys[:, 4, 0], keys[:, 5, 0], keys[:, 6, 0] = basis(0, 1.0), basis(0, 2.0), basis(0, 1.5)
    keys[:, 7, 1] = basis(2, 1.0)  # on KV head 1, which query heads 2 and 3 read (repeat_kv: h // group)
    view.mean_key = keys
    query = torch.zeros(2, HEADS, DIM)
    query[:, 0] = basis(0)  # query head 0 reads KV head 0
    query[:, 2] = basis(2, 1.8)
    view.sentence_query = query
    decisions = SentenceKV().decide(view)
    # every block is its own sentence: scores 5 -> 2, 7 -> 1.8 (head 2 on KV head 1), 6 -> 1.5, 4 -> 1
    assert ops(decisions, Op.PREFETCH) == [5] and ops(decisions, Op.EVICT) == [2, 3]


def test_sentencekv_cold_start_keeps_the_device_set(tiny_model):
    # one decode query so far (<= length_threshold): the reference code attends everything it kept
    cache = filled(tiny_model, prompt=159, decode_steps=1, host_evicted=(4, 5, 6), sentence_ends=(31, 63, 95, 127))
    view = CacheView.from_cache(cache, [6, 6], phase="decode")
    view.mean_key = basis(0).expand(2, 10, KV_HEADS, DIM).clone()
    view.sentence_query = basis(0).expand(2, HEADS, DIM).clone()
    view.last_mass_heads[:] = one_hot_mass(view, {0: 4, 1: 1, 2: 3, 3: 0.5, 7: 2, 8: 1, 9: 1})[:, None]
    decisions = SentenceKV().decide(view)
    assert ops(decisions, Op.PREFETCH) == [] and ops(decisions, Op.EVICT) == [3]  # over budget by one: lowest mass
    cache.sentence_query_count = 0  # right after a sentence end: no sentence query at all
    view = CacheView.from_cache(cache, [7, 7], phase="decode")
    assert view.sentence_query is None
    assert SentenceKV().decide(view) == []  # within budget: nothing moves


def test_sentencekv_prefill_prefilter_forgets_blocks_for_good(tiny_model):
    cache = filled(tiny_model, prompt=160)  # a prefill chunk: last_mass is the window's attention (64 queries)
    controller = SentenceKV(semantic_factor=1.0)  # the store keeps r * 6 = 6 blocks
    view = CacheView.from_cache(cache, [6, 6])
    view.last_mass_heads[:] = torch.tensor([10, 10, 5, 1, 4, 0.5, 3, 2, 10, 10.0])
    decisions = controller.decide(view)
    # sink 0 1 and recent 8 9, then the window's top blocks 2 and 4; 3 5 6 7 leave the store (and the device)
    assert ops(decisions, Op.EVICT) == [3, 5, 6, 7] and ops(decisions, Op.PREFETCH) == []
    assert controller._forgotten[0].nonzero().flatten().tolist() == [3, 5, 6, 7]
    apply_decisions(cache, decisions)
    assert cache.tables.tier[0, [3, 5, 6, 7]].tolist() == [Tier.HOST] * 4  # EVICT offloads: no drop in the API
    with torch.no_grad():
        for _ in range(2):
            tiny_model(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)
    view = CacheView.from_cache(cache, [6, 6], phase="decode")  # blocks 0..10; recent 8 9 10; one slot left
    keys = torch.zeros(2, 11, KV_HEADS, DIM)
    keys[:, 3], keys[:, 4], keys[:, 2] = basis(0, 9.0), basis(0, 2.0), basis(0, 1.0)
    view.mean_key = keys
    view.sentence_query = basis(0).expand(2, HEADS, DIM).clone()
    decisions = controller.decide(view)
    assert ops(decisions, Op.PREFETCH) == [] and ops(decisions, Op.EVICT) == [2]  # block 3 matches best: forgotten


# ------------------------------------------------------------------------------------------------------ Quest
def test_quest_bound_is_an_upper_bound_of_every_qk_in_the_page():
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        layers, pages, kv_heads, group, dim = 2, 7, 2, 3, 8
        keys = torch.randn(layers, pages, 16, kv_heads, dim, generator=generator) * 3
        query = torch.randn(layers, kv_heads * group, dim, generator=generator) * 3
        bound = page_bounds(query, keys.amin(dim=2), keys.amax(dim=2))  # [L, pages, heads]
        expanded = keys.repeat_interleave(group, dim=3)  # repeat_kv: head h reads KV head h // group
        qk = torch.einsum("lptHd,lHd->lptH", expanded, query)
        assert torch.all(bound[:, :, None] >= qk - 1e-4)
        # the reference code's form: |q| · max_t(sign(q) k_t)
        sign = torch.where(query > 0, 1.0, -1.0)
        reference = torch.einsum("lHd,lpHd->lpH", query * sign, (expanded * sign[:, None, None]).amax(dim=2))
        assert torch.allclose(bound, reference, atol=1e-4)
    key_min, key_max = keys.amin(dim=2), keys.amax(dim=2)
    key_min[0, 3], key_max[0, 3] = float("inf"), float("-inf")  # a page without keys: unbounded, not NaN
    bound = page_bounds(query, key_min, key_max)
    assert torch.isinf(bound[0, 3]).all() and (bound[0, 3] > 0).all() and torch.isfinite(bound[0, :3]).all()
    one = torch.randn(1, 5, 1, 2, 4, generator=generator)  # one-token pages: the bound is exact
    query = torch.randn(1, 2, 4, generator=generator)
    assert torch.allclose(page_bounds(query, one.amin(dim=2), one.amax(dim=2)),
                          torch.einsum("lpHd,lHd->lpH", one[:, :, 0], query), atol=1e-5)


def test_quest_bound_from_the_cache_statistics_covers_the_real_keys(tiny_model):
    cache = filled(tiny_model, prompt=100, decode_steps=1)
    view = CacheView.from_cache(cache, [8, 8])
    bound = page_bounds(view.last_query, view.key_min, view.key_max)
    for layer in range(2):
        keys = cache.resident_keys_values(layer)[0][0].float()  # [kv_heads, 101, dim]
        qk = torch.einsum("Htd,Hd->Ht", keys.repeat_interleave(2, dim=0), view.last_query[layer])
        for page in range(view.num_blocks):
            assert torch.all(bound[layer, page, :, None] >= qk[:, page * 16 : (page + 1) * 16] - 1e-4)


def test_quest_makes_the_device_set_the_pages_with_the_largest_bounds(tiny_model):
    cache = filled(tiny_model, host_evicted=(3, 4, 5))  # device 0 1 2 6 7 8 9
    view = CacheView.from_cache(cache, [5, 5], phase="question")
    scale = torch.tensor([1, 1, 2, 3, 5, 1, 0.5, 4, 1, 0.0])  # pinned 0 and 9 stay whatever their bounds
    view.key_min = view.key_max = (scale[:, None, None] * basis(0)).expand(2, 10, KV_HEADS, DIM).clone()
    view.last_query = basis(0).expand(2, HEADS, DIM).clone()
    decisions = Quest().decide(view)
    # top 3 unpinned bounds: 4 (host) 7 (device) 3 (host); prefetches first: the device pool has free slots
    assert [(d.op, d.block) for d in decisions if d.layer == 0] == [
        (Op.PREFETCH, 4), (Op.PREFETCH, 3), (Op.EVICT, 1), (Op.EVICT, 2), (Op.EVICT, 6), (Op.EVICT, 8)]
    apply_decisions(cache, decisions)
    assert device_set(cache) == [0, 3, 4, 7, 9] == device_set(cache, 1)
    assert cache.tables.tier[0, [1, 2, 5, 6, 8]].tolist() == [Tier.HOST] * 5  # nothing dropped


def test_quest_combines_heads_by_max_or_sum(tiny_model):
    cache = filled(tiny_model)
    view = CacheView.from_cache(cache, [3, 3], phase="decode")  # pinned 0 and 9 + one page
    keys = torch.zeros(2, 10, KV_HEADS, DIM)
    keys[:, 3, 0] = basis(0, 5.0)  # one head sees a large bound on page 3
    keys[:, 6] = basis(1, 2.0)  # every head sees a moderate bound on page 6
    view.key_min = view.key_max = keys
    view.last_query = (basis(0) + basis(1)).expand(2, HEADS, DIM).clone()
    # page 3: heads 0, 1 -> 5, heads 2, 3 -> 0 (max 5, sum 10); page 6: 2 for all four (max 2, sum 8)
    assert 6 in ops(Quest().decide(view), Op.EVICT) and 3 not in ops(Quest().decide(view), Op.EVICT)
    keys[:, 3, 0] = basis(0, 3.0)  # max 3 > 2, but sum 6 < 8
    assert 3 in ops(Quest(head_reduction="sum").decide(view), Op.EVICT)
    assert 6 not in ops(Quest(head_reduction="sum").decide(view), Op.EVICT)
    with pytest.raises(ValueError, match="head_reduction"):
        Quest(head_reduction="mean")
    with pytest.raises(ValueError, match="queries"):
        Quest(queries="all")


def test_quest_exact_keeps_the_pages_the_window_attends_most_offloaded_ones_prefetched(tiny_model):
    cache = filled(tiny_model, prompt=100, decode_steps=1, host_evicted=(3, 4))
    view = CacheView.from_cache(cache, [4, 4], phase="decode")
    share = torch.zeros(2, view.num_blocks, HEADS)
    share[:, 3, 1] = 0.5  # one head attends offloaded page 3 most, then device page 5
    share[:, 5] = 0.2
    view.window_attention_share = share
    decisions = Quest(queries="exact").decide(view)
    assert 3 in ops(decisions, Op.PREFETCH) and 5 not in ops(decisions, Op.EVICT)
    assert 4 not in ops(decisions, Op.PREFETCH)
    # negative control: Quest's own bounds rank other pages (the decision differs)
    assert sorted(ops(Quest().decide(view), Op.PREFETCH)) != sorted(ops(decisions, Op.PREFETCH))


def test_window_bound_share_is_each_window_query_s_softmax_of_its_bounds_averaged(tiny_model):
    """``page_bounds`` of several queries equals one call per query; ``window_bound_share`` is, per head, the
    mean over the window's queries of the softmax (over live blocks) of bound / √dim, a distribution per head.
    Negative control: the share of the last query alone differs."""
    cache = filled(tiny_model, prompt=100, decode_steps=1, host_evicted=(3, 4))
    view = CacheView.from_cache(cache, [8, 8], phase="question")
    view.window_queries = [torch.randn(HEADS, 5, DIM, generator=torch.Generator().manual_seed(layer))
                           for layer in range(2)]
    queries = torch.stack(view.window_queries)  # [L, heads, q, dim]
    several = page_bounds(queries, view.key_min, view.key_max)
    for q in range(5):
        assert torch.allclose(several[..., q], page_bounds(queries[:, :, q], view.key_min, view.key_max), atol=1e-5)
    live = (view.tier != Tier.DROPPED) & (view.num_tokens > 0)
    expected = torch.stack([torch.softmax(several[..., q] / DIM**0.5 + torch.where(live, 0.0, -torch.inf)[..., None],
                                          dim=1) for q in range(5)]).mean(dim=0)
    share = view.window_bound_share
    assert torch.allclose(share, expected, atol=1e-6)
    assert torch.allclose(share.sum(dim=1), torch.ones(2, HEADS), atol=1e-5)
    assert share[0, 3].sum() > 0  # an offloaded block gets its share
    assert not torch.allclose(share, torch.softmax(several[..., -1] / DIM**0.5, dim=1), atol=1e-3)
    decode = CacheView.from_cache(cache, [8, 8], phase="decode")  # a decode step's window: its one query
    assert decode.window_queries[0].shape[1] == 1
    one = page_bounds(torch.stack(decode.window_queries), decode.key_min, decode.key_max)[..., 0]
    assert torch.allclose(decode.window_bound_share, torch.softmax(one / DIM**0.5 + torch.where(
        live, 0.0, -torch.inf)[..., None], dim=1), atol=1e-6)


def test_quest_with_a_full_host_never_prefetches_dropped_pages(tiny_model):
    cache = filled(tiny_model, host_blocks=1, host_evicted=(3, 4))  # 3 -> host (now full), 4 -> dropped
    assert cache.tables.tier[0, [3, 4]].tolist() == [Tier.HOST, Tier.DROPPED]
    view = CacheView.from_cache(cache, [7, 7], phase="decode")  # device 0 1 2 5 6 7 8 9: one over
    scale = torch.tensor([0, 0.1, 0.2, 8, 9, 5, 5, 5, 5, 0])
    view.key_min = view.key_max = (scale[:, None, None] * basis(0)).expand(2, 10, KV_HEADS, DIM).clone()
    view.last_query = basis(0).expand(2, HEADS, DIM).clone()
    decisions = Quest().decide(view)
    assert 4 not in ops(decisions, Op.PREFETCH)
    assert [(d.op, d.block) for d in decisions if d.layer == 0] == [(Op.PREFETCH, 3), (Op.EVICT, 1), (Op.EVICT, 2)]
    apply_decisions(cache, decisions)
    # the prefetch freed the host slot first, so block 1 is offloaded; only block 2 found every tier full
    assert cache.tables.tier[0, :5].tolist() == [Tier.DEVICE, Tier.HOST, Tier.DROPPED, Tier.DEVICE, Tier.DROPPED]


# ------------------------------------------------------------------------------------------------------- runs
@pytest.mark.parametrize("controller", [SentenceKV(), Quest()], ids=["sentencekv", "quest"])
def test_retrieval_runs_meet_the_budget_through_the_host_tier(tiny_model, controller):
    checked = Checked(controller)
    runner = Runner(tiny_model, controller=checked, budget=8, prefill_chunk=64, decide_every=3,
                    cache_config=CacheConfig(host_blocks=64))
    runner.sentence_end_ids = torch.tensor([7, 11, 13, 17, 19])  # a few "punctuation" ids
    result = runner.run(torch.randint(2, 256, (1, 300), generator=torch.Generator().manual_seed(0)),
                        max_new_tokens=48, stop_at_eos=False)
    assert checked.calls > 0 and result.fallbacks == 0
    assert max(result.blocks_per_tier["device"]) <= 8 and result.blocks_per_tier["dropped"] == [0, 0]
    assert result.operations["prefetch"] > 0 and result.bytes_moved["host->device"] > 0
