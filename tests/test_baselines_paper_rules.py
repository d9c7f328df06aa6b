"""Each baseline's paper rule on a hand-built view (a tiny-model cache with chosen statistics, keys or values written
over it), with a negative control: a rule the paper does not use gives another answer on the same view."""

import pytest
import torch

from agents.baselines import expected_attention as expected_module
from agents.baselines import kvzip as kvzip_module
from agents.baselines.base import evict_lowest, pyramid_split, rope_cos_sin, token_scores_per_block, unrotate
from agents.baselines.expected_attention import (
    ExpectedAttention,
    average_rotation,
    expected_scores,
    moments,
    prompt_query_moments,
    window_query_moments,
)
from agents.baselines.h2o import H2O
from agents.baselines.keydiff import KeyDiff
from agents.baselines.knorm import Knorm, negative_key_norm
from agents.baselines.kvzip import KVzip, reconstruction_mass
from agents.baselines.observed_attention import ObservedAttention
from agents.baselines.pyramidkv import PyramidKV
from agents.baselines.quest import Quest
from agents.baselines.sentencekv import SentenceKV
from agents.baselines.snapkv import SnapKV
from agents.baselines.spindlekv import SpindleKV
from agents.baselines.tova import TOVA
from cache.attention import PAGED_ATTENTION
from cache.controller import CacheView, Op, apply_decisions
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.tiers import Tier
from tests.conftest import make_tiny_llama

HEADS, KV_HEADS, DIM = 4, 2, 16  # the tiny model


@torch.no_grad()
def prefilled(model, tokens=160, host_blocks=0, ids=None):
    """A cache after one forward of ``tokens`` random ids (blocks 0..9 for 160; 0 and the newest are pinned)."""
    cache = PagedKVCache(model.config, CacheConfig(host_blocks=host_blocks))
    if ids is None:
        ids = torch.randint(2, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids[None], cache=cache, use_cache=True)
    return cache


def evicted(decisions, layer=0, op=Op.EVICT):
    return sorted(d.block for d in decisions if d.layer == layer and d.op == op)


def basis(index, scale=1.0):
    vector = torch.zeros(DIM)
    vector[index] = scale
    return vector


def write_block(cache, layer, block, keys, values=None):
    """Overwrite a device block's post-RoPE keys (and values), ``[16, kv_heads, dim]`` or broadcastable."""
    pool, physical = cache.device_pool(layer), cache.tables.physical[layer, block]
    pool.keys[physical] = keys
    if values is not None:
        pool.values[physical] = values
    cache.summarize_keys(layer, torch.tensor([block]))
    cache.layers[layer].mirror_stale = True


# ------------------------------------------------------------------------------------------------------ TOVA
def test_tova_ranks_by_the_last_query_not_the_window(tiny_model):
    view = CacheView.from_cache(prefilled(tiny_model), [5, 5], phase="compress")
    view.last_query_heads[0] = torch.tensor([9, 0.2, 3, 0.1, 4, 0.3, 2, 0.4, 1, 0.05])
    view.last_mass_heads[0] = torch.tensor([9, 8, 0.1, 7, 0.2, 6, 0.3, 5, 0.4, 5.0])  # the 64-query window
    # sink 0 and newest 9 pinned; the last query's three best of 1..8: 4 (4), 2 (3), 6 (2)
    assert evicted(TOVA().decide(view)) == [1, 3, 5, 7, 8]
    # negative control: the same eviction by the window's mass keeps 1, 3, 5
    assert evicted(evict_lowest(view, view.mass("last"))) == [2, 4, 6, 7, 8]


def test_max_over_heads_keeps_a_block_a_single_head_needs(tiny_model):
    view = CacheView.from_cache(prefilled(tiny_model), [3, 3], phase="decode")
    heads = torch.full((HEADS, 10), 0.1)
    heads[:, 5] = 0.35  # every head: a moderate block 5 (mean 0.35)
    heads[2, 3] = 0.9  # one retrieval head: block 3 (mean 0.3, max 0.9)
    view.last_query_heads[0] = heads
    assert 3 not in evicted(TOVA(aggregation="max").decide(view))
    assert 3 in evicted(TOVA().decide(view))  # the paper's mean drowns the head
    with pytest.raises(ValueError, match="aggregation"):
        TOVA(aggregation="sum")


# ------------------------------------------------------------------------------------ H2O vs ObservedAttention
def test_h2o_sums_attention_while_observed_attention_divides_by_the_queries_that_saw_it(tiny_model):
    cache = prefilled(tiny_model)
    # as if every query of the 160-token prompt had been counted: token p is seen by 160 - p queries
    block_starts = torch.arange(10) * 16
    cache.stats.observers[:, :10] = (16 * 160 - 16 * block_starts - 120).float()
    view = CacheView.from_cache(cache, [6, 6], phase="compress")
    view.acc_mass_heads[0] = torch.tensor([50, 40, 30, 20, 15, 14, 12, 5, 3, 1.0])
    # per query that saw them (152.5 - 16 b on average): 1: .293, 2: .249, 3: .191, 4: .169, 5: .193, 6: .212
    # H2O (budget 6 = recent 7, 8, 9 + sink + the 2 largest sums of 1..6)
    assert evicted(H2O().decide(view)) == [3, 4, 5, 6]
    # ObservedAttention (no window): the 4 best means of 1..8: 1, 2, 6, 5; block 6 (12) now beats block 3 (20)
    assert evicted(ObservedAttention().decide(view)) == [3, 4, 7, 8]
    # negative control: the same eviction by the plain sum keeps 1..4 instead
    assert evicted(evict_lowest(view, view.mass("acc"))) == [5, 6, 7, 8]


# ------------------------------------------------------------------------------------------- Knorm, KeyDiff
def test_knorm_keeps_the_lowest_norm_keys_and_a_block_is_worth_its_best_token(tiny_model):
    cache = prefilled(tiny_model)
    norms = [1, 5, 1, 4, 2, 6, 3, 7, 8, 1]
    for block, norm in enumerate(norms):
        write_block(cache, 0, block, basis(0, norm))
    keys = basis(0, 7).expand(16, KV_HEADS, DIM).clone()
    keys[5] = basis(0, 0.5)  # one low-norm token in block 7
    write_block(cache, 0, 7, keys)
    view = CacheView.from_cache(cache, [5, 5], phase="compress")
    # the three best of 1..8: 7 (its 0.5 token), 2 (1), 4 (2)
    assert evicted(Knorm().decide(view)) == [1, 3, 5, 6, 8]
    # negative control: a block scored by all its tokens (the sum) drops 7 for 6 (norm 3)
    assert evicted(evict_lowest(view, token_scores_per_block(view, negative_key_norm, "sum"))) == [1, 3, 5, 7, 8]


def test_keydiff_keeps_the_keys_least_like_the_anchor_whatever_their_norm(tiny_model):
    cache = prefilled(tiny_model)
    for block in range(10):
        write_block(cache, 0, block, basis(0, 1.0))
    write_block(cache, 0, 5, basis(1, 10.0))  # distinctive, and the largest norm
    write_block(cache, 0, 3, basis(0) + basis(1, 0.5))  # partly distinctive
    write_block(cache, 0, 7, basis(0) + basis(2, 0.2))  # a little distinctive
    write_block(cache, 0, 2, basis(0, 0.1))  # like the anchor, smallest norm
    view = CacheView.from_cache(cache, [5, 5], phase="compress")
    assert evicted(KeyDiff().decide(view)) == [1, 2, 4, 6, 8]
    # negative control: Knorm keeps the smallest norm (2) and evicts the distinctive block 5
    knorm = evicted(Knorm().decide(view))
    assert 5 in knorm and 2 not in knorm


# ----------------------------------------------------------------------------------------- Expected Attention
def test_expected_scores_follow_the_gaussian_rule():
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])[:, None]  # [T=3, kv_heads=1, d=2]
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 10.0]])[:, None]
    mean = torch.tensor([[1.0, 0.0]])  # one query head
    covariance = torch.diag(torch.tensor([0.0, 4.0]))[None]
    # E[exp(q.k / sqrt d)] ∝ exp(k.mu / sqrt 2 + k' Sigma k / 4): 0.707, 1.0, -0.707
    with_covariance = torch.softmax(torch.tensor([2 ** -0.5, 1.0, -(2 ** -0.5)]), dim=0)
    assert torch.allclose(expected_scores(keys, values, mean, covariance, False, 0.0)[0], with_covariance)
    # negative control: the mean alone ranks the first key first
    mean_only = expected_scores(keys, values, mean, None, False, 0.0)[0]
    assert int(mean_only.argmax()) == 0 and int(with_covariance.argmax()) == 1
    # the value norm rescales: (p + eps) * |v|
    assert torch.allclose(expected_scores(keys, values, mean, covariance, True, 0.1)[0],
                          (with_covariance + 0.1) * torch.tensor([1.0, 1.0, 10.0]))


def test_average_rotation_is_the_mean_rope_rotation(tiny_model):
    config = tiny_model.config
    cos, sin = rope_cos_sin(config, torch.arange(100, 108))
    rotations = []
    for c, s in zip(cos, sin, strict=True):  # R_p e_j = e_j cos_p + rotate_half(e_j) sin_p
        eye = torch.eye(DIM)
        rotations.append((eye * c[None] + torch.cat([-eye[:, DIM // 2:], eye[:, : DIM // 2]], dim=1) * s[None]).T)
    assert torch.allclose(average_rotation(config, 100, 8), torch.stack(rotations).mean(dim=0), atol=1e-6)


def test_window_moments_are_those_of_the_pre_rope_queries(tiny_model):
    cache = prefilled(tiny_model)
    pre = torch.randn(HEADS, 64, DIM, generator=torch.Generator().manual_seed(4))
    cos, sin = rope_cos_sin(tiny_model.config, torch.arange(96, 160))
    rotated = pre * cos[None] + torch.cat([-pre[..., DIM // 2:], pre[..., : DIM // 2]], dim=-1) * sin[None]
    assert torch.allclose(unrotate(rotated.transpose(0, 1), cos, sin).transpose(0, 1), pre, atol=1e-5)
    cache.window_queries = [rotated, rotated]
    view = CacheView.from_cache(cache, [5, 5])
    mean, covariance = window_query_moments(view, n_sink=4)[0]
    assert torch.allclose(mean, pre.mean(dim=1), atol=1e-5)
    assert torch.allclose(covariance, moments(pre)[1], atol=1e-5)


def test_prompt_moments_are_those_of_every_q_proj_output_but_the_sinks(tiny_model):
    ids = torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(5))
    found = prompt_query_moments(tiny_model, ids, n_sink=4)
    with torch.no_grad():
        hidden = tiny_model.model(input_ids=ids[None], output_hidden_states=True).hidden_states
        for layer, block in enumerate(tiny_model.model.layers):
            queries = block.self_attn.q_proj(block.input_layernorm(hidden[layer]))[0, 4:]
            mean, covariance = moments(queries.reshape(-1, HEADS, DIM).transpose(0, 1))
            assert torch.allclose(found[layer][0], mean, atol=1e-5)
            assert torch.allclose(found[layer][1], covariance, atol=1e-5)


def test_expected_attention_keeps_the_block_the_query_distribution_points_at(tiny_model, monkeypatch):
    cache = prefilled(tiny_model)
    direction = basis(3)
    cache.window_queries = [direction.expand(HEADS, 8, DIM).clone() for _ in range(2)]  # post-RoPE
    view = CacheView.from_cache(cache, [3, 3], phase="prefill")
    pre_mean = window_query_moments(view, 4)[0][0][0]  # the pre-RoPE mean query of head 0
    target = average_rotation(tiny_model.config, 160, 512) @ pre_mean  # where future queries point, on average
    for block in range(10):
        write_block(cache, 0, block, torch.zeros(DIM))
    write_block(cache, 0, 6, 8 * target / target.norm())
    view = CacheView.from_cache(cache, [3, 3], phase="prefill")
    view.window_queries = [direction.expand(HEADS, 8, DIM).clone() for _ in range(2)]
    view.last_query_heads[0] = torch.tensor([1, 0, 5, 0, 0, 0, 0, 0, 0, 1.0])  # observed attention: block 2
    assert evicted(ExpectedAttention().decide(view)) == [1, 2, 3, 4, 5, 7, 8]
    assert evicted(TOVA().decide(view)) == [1, 3, 4, 5, 6, 7, 8]  # negative control: the observed query keeps 2
    # statistics: every prompt query at compress (one extra forward), the latest window anywhere else
    calls = []
    monkeypatch.setattr(expected_module, "prompt_query_moments",
                        lambda model, ids, n_sink: calls.append(len(ids)) or window_query_moments(view, n_sink))
    ExpectedAttention().decide(view)
    assert calls == []
    compress = CacheView.from_cache(cache, [3, 3], phase="compress", model=tiny_model, token_ids=torch.arange(160))
    compress.window_queries = view.window_queries
    assert evicted(ExpectedAttention().decide(compress)) == [1, 2, 3, 4, 5, 7, 8] and calls == [160]


# ---------------------------------------------------------------------------------------------------- KVzip
def test_kvzip_keeps_the_blocks_a_reconstruction_query_needs_most(tiny_model, monkeypatch):
    cache = prefilled(tiny_model)
    peaks = torch.full((2, HEADS, 10), 0.1)
    peaks[:, :, 6] = 0.4  # every head moderately
    peaks[:, 1, 4] = 0.9  # one head's reconstruction needs block 4 sharply (mean 0.3)
    monkeypatch.setattr(kvzip_module, "reconstruction_mass", lambda view, chunk_size: peaks)
    kvzip_module.forget_reconstructions()  # the same model and prompt as another test: its remembered scores
    view = CacheView.from_cache(cache, [3, 3], phase="compress", model=tiny_model, token_ids=torch.arange(160))
    controller = KVzip(per_head=False)
    assert evicted(controller.decide(view)) == [1, 2, 3, 5, 6, 7, 8]  # the max over heads keeps 4
    assert evicted(KVzip(aggregation="mean", per_head=False).decide(view)) == [1, 2, 3, 4, 5, 7, 8]  # negative control
    # later decisions reuse the reconstruction: prompt blocks by score go first, newer blocks after them
    with torch.no_grad():
        for _ in range(2):
            tiny_model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True)  # block 10 opens
    apply_decisions(cache, controller.decide(view))
    decode = CacheView.from_cache(cache, [3, 3], phase="decode")
    assert evicted(controller.decide(decode)) == [9]  # kept 0, 4, 9: the prompt block of lowest score goes


def test_kvzip_prunes_over_all_layers_unless_layerwise(tiny_model, monkeypatch):
    """kvpress's default (layerwise=False): the lowest scores over every layer go, so a layer whose blocks the
    reconstruction needs keeps more of them; layerwise=true (the negative control) keeps the same share per layer."""
    from agents.registry import make_controller

    peaks = torch.full((2, HEADS, 10), 0.1)
    peaks[0, :, 1:9] = 0.5  # layer 0's blocks all outscore layer 1's
    peaks[1, :, 3] = 0.3
    monkeypatch.setattr(kvzip_module, "reconstruction_mass", lambda view, chunk_size: peaks)
    kvzip_module.forget_reconstructions()  # the same model and prompt as another test: its remembered scores
    assert make_controller("kvzip").budget_scope == "global" and make_controller("kvzip").per_head
    assert make_controller("kvzip:layerwise=true").budget_scope == "layer"
    view = CacheView.from_cache(prefilled(tiny_model), [3, 3], phase="compress", model=tiny_model,
                                token_ids=torch.arange(160), total_budget=6)
    decisions = KVzip(per_head=False).decide(view)
    assert evicted(decisions, layer=1) == [1, 2, 3, 4, 5, 6, 7, 8]  # layer 1 keeps its pinned 0 and 9
    assert evicted(decisions) == [1, 2, 3, 4, 5, 6]  # layer 0 keeps 0, 9 and two more (ties: the oldest go)
    layer_view = CacheView.from_cache(prefilled(tiny_model), [3, 3], phase="compress", model=tiny_model,
                                      token_ids=torch.arange(160))
    per_layer = KVzip(layerwise=True, per_head=False).decide(layer_view)
    assert evicted(per_layer, layer=1) == [1, 2, 4, 5, 6, 7, 8] and len(evicted(per_layer)) == 7


def test_kvzip_reconstructs_a_prompt_once_for_every_one_shot_run(tiny_model, monkeypatch):
    """The reconstruction is KVzip's whole cost and depends only on the model and the prompt at ``compress``: a grid
    of budgets reuses it; another prompt, another model or another phase computes it afresh."""
    from tests.conftest import make_tiny_llama

    calls = []
    monkeypatch.setattr(kvzip_module, "reconstruction_mass",
                        lambda view, chunk_size: calls.append(view.phase) or torch.rand(2, HEADS, view.num_blocks))
    kvzip_module.forget_reconstructions()

    def compress(model, budget, ids=None, phase="compress"):
        ids = torch.arange(160) if ids is None else ids
        view = CacheView.from_cache(prefilled(model, ids=ids), [budget] * 2, phase=phase, model=model, token_ids=ids)
        return KVzip().decide(view)

    first = compress(tiny_model, 3)
    assert compress(tiny_model, 3) == first and len(calls) == 1
    compress(tiny_model, 5)
    assert len(calls) == 1  # another budget: the same reconstruction
    compress(tiny_model, 3, ids=torch.arange(1, 161))
    compress(make_tiny_llama(seed=1), 3)
    compress(tiny_model, 3, phase="question")
    assert calls == ["compress", "compress", "compress", "question"]


def test_kvzip_before_any_reconstruction_keeps_the_newest_blocks(tiny_model):
    view = CacheView.from_cache(prefilled(tiny_model), [4, 4], phase="prefill")
    assert evicted(KVzip().decide(view)) == [1, 2, 3, 4, 5, 6]


def test_kvzip_reconstruction_is_the_peak_attention_of_the_repeated_context():
    model = make_tiny_llama()  # no tokenizer: the repeat input is the context itself, no instruction
    ids = torch.randint(2, 256, (150,), generator=torch.Generator().manual_seed(6))  # fed in two pieces
    cache = prefilled(model, ids=ids)
    view = CacheView.from_cache(cache, [3, 3], phase="compress", model=model, token_ids=ids)
    mass = reconstruction_mass(view, chunk_size=2048)  # [L, H, 10 blocks]; block 9 (6 tokens) is the pinned newest
    model.set_attn_implementation("eager")  # the reference: the context and its repetition in one forward
    try:
        with torch.no_grad():
            attentions = model(input_ids=torch.cat([ids, ids])[None], output_attentions=True).attentions
    finally:
        model.set_attn_implementation(PAGED_ATTENTION)
    for layer, attention in enumerate(attentions):
        rows = attention[0, :, 150:, :150]  # [H, repeat queries, context keys]
        per_block = torch.stack([rows[..., b * 16 : (b + 1) * 16].sum(dim=-1) for b in range(9)], dim=-1)
        assert torch.allclose(mass[layer, :, :9], per_block.amax(dim=1), atol=1e-5)


# ------------------------------------------------------------------------------------------------- PyramidKV
def test_pyramid_split_spends_the_same_total_in_a_linear_pyramid():
    assert pyramid_split([8] * 4, beta=20) == [15, 10, 5, 2]  # 15.6, 10.5, 5.5, 0.4 -> the 2 pinned blocks
    assert pyramid_split([8] * 4, beta=1) == [8] * 4  # beta 1: uniform (kvpress's fallback to SnapKV)
    for budget in ([32] * 30, [5] * 7, [3, 4, 5], [2] * 5):
        split = pyramid_split(budget, beta=20)
        assert sum(split) == sum(budget) and min(split) >= 2
        assert all(a >= b for a, b in zip(split, split[1:], strict=False))


def test_pyramidkv_selects_like_snapkv_within_its_layer_budgets(tiny_model):
    controller = PyramidKV(beta=2.0)
    budgets = controller.layer_budgets([5, 5])  # mean 5: 7.5, 2.5 -> same total, most in layer 0
    assert budgets == [8, 2]
    view = CacheView.from_cache(prefilled(tiny_model), budgets, phase="compress")
    view.last_mass_heads[:] = torch.tensor([5, 1, 4, 0.5, 3, 2, 1, 1, 1, 1.0])  # the window: blocks 6..9
    # layer 0 keeps 8: sink, window 6..9 and the 3 best pooled of 1..5; layer 1 only the pinned 0 and 9
    assert evicted(controller.decide(view)) == [1, 3]
    assert evicted(controller.decide(view), layer=1) == [1, 2, 3, 4, 5, 6, 7, 8]
    snapkv = SnapKV(kernel_size=5, pooling="avgpool")  # negative control: uniform budgets
    assert not hasattr(snapkv, "layer_budgets")
    uniform = CacheView.from_cache(prefilled(tiny_model), [5, 5], phase="compress")
    assert len(evicted(snapkv.decide(uniform))) == len(evicted(snapkv.decide(uniform), layer=1)) == 5


# ------------------------------------------------------------------------------------------------- SpindleKV
def test_spindlekv_spends_the_total_budget_shallow_uniform_deep_pyramid():
    controller = SpindleKV()  # 4 layers: 1 shallow
    assert controller.layer_budgets([8] * 4) == [8, 14, 8, 2]
    assert sum(SpindleKV().layer_budgets([32] * 30)) == 32 * 30


def test_spindlekv_merges_a_block_whose_pre_rope_keys_and_values_repeat_another(tiny_model):
    ids = torch.randperm(254, generator=torch.Generator().manual_seed(7))[:160] + 2  # no token twice
    cache = prefilled(tiny_model, ids=ids)
    view = CacheView.from_cache(cache, [8, 8], phase="compress")
    assert evicted(SpindleKV().decide(view), op=Op.MERGE) == []  # control: distinct tokens never merge
    # block 4 repeats block 2's tokens: the same pre-RoPE keys and values, rotated at block 4's positions
    pool, physical = cache.device_pool(0), cache.tables.physical[0]
    cos2, sin2 = rope_cos_sin(tiny_model.config, torch.arange(32, 48))
    cos4, sin4 = rope_cos_sin(tiny_model.config, torch.arange(64, 80))
    pre = unrotate(pool.keys[physical[2]].float(), cos2, sin2)
    rotated = pre * cos4[:, None] + torch.cat([-pre[..., DIM // 2:], pre[..., : DIM // 2]], dim=-1) * sin4[:, None]
    write_block(cache, 0, 4, rotated, pool.values[physical[2]].clone())
    view = CacheView.from_cache(cache, [8, 8], phase="compress")
    assert view.neighbour_similarity[0, 4] < 0.98  # negative control: post-RoPE block means never reach θ_K
    decisions = SpindleKV().decide(view)
    # one of the pair merges (the older, on the tie); the other then has no duplicate left and is scored
    assert evicted(decisions, op=Op.MERGE) == [2]
    assert len(evicted(decisions)) == 1 and evicted(decisions, layer=1, op=Op.MERGE) == []  # layer 1 is deep
    apply_decisions(cache, decisions)
    assert cache.blocks_per_tier()["device"] == [8, 8]


# ------------------------------------------------------------------------------------------- Quest, SentenceKV
def test_quest_prefill_keeps_the_newest_pages_and_selects_once_the_question_is_read(tiny_model):
    cache = prefilled(tiny_model, host_blocks=32)
    scale = torch.tensor([1, 9, 8, 0, 0, 0, 0, 0, 0, 0.0])  # the bounds favour the old pages 1 and 2
    views = {}
    for phase in ("prefill", "question"):
        views[phase] = CacheView.from_cache(cache, [5, 5], phase=phase)
        views[phase].key_min = views[phase].key_max = (scale[:, None, None] * basis(0)).expand(2, 10, KV_HEADS, DIM)
        views[phase].last_query = basis(0).expand(2, HEADS, DIM).clone()
    assert evicted(Quest().decide(views["prefill"])) == [1, 2, 3, 4, 5]  # dense as possible: newest stay
    assert 1 not in evicted(Quest().decide(views["question"]))  # negative control: the selection keeps 1, 2
    assert 2 not in evicted(Quest().decide(views["question"]))
    apply_decisions(cache, Quest().decide(views["prefill"]))
    assert cache.tables.tier[0, 1:6].tolist() == [Tier.HOST] * 5  # offloaded, not dropped


def test_sentencekv_retrieves_with_the_question_before_the_first_answer_token(tiny_model):
    cache = prefilled(tiny_model, host_blocks=32)
    cache.observe_tokens(0, torch.isin(torch.arange(160), torch.tensor([31, 63, 95, 127, 156])))
    for layer in range(2):
        for block in (4, 5, 6):
            cache.evict(layer, block)  # on the host
    keys = basis(1).expand(2, 10, KV_HEADS, DIM).clone()
    keys[:, 4:6] = basis(0)  # sentence 2 (blocks 4, 5, on the host) matches the question
    # the window: positions 155..159; the sentence in progress starts after the end at 156
    window = torch.stack([basis(1, 10.0)] * 2 + [basis(0)] * 3).expand(HEADS, 5, DIM).clone()
    decisions = {}
    for phase in ("question", "prefill"):
        view = CacheView.from_cache(cache, [6, 6], phase=phase)
        view.mean_key, view.window_queries = keys, [window, window]
        decisions[phase] = SentenceKV().decide(view)
    # sink blocks 0, 1 and recent 8, 9 stay; the two free slots go to sentence 2, fetched from the host
    assert evicted(decisions["question"], op=Op.PREFETCH) == [4, 5]
    assert evicted(decisions["prefill"], op=Op.PREFETCH) == []  # negative control: no retrieval before it
    # negative control: the whole window's mean query (4 e1 + 0.6 e0) would keep the device blocks 2, 3
    cache.sentence_end[:160] = False
    view.phase = "question"
    assert evicted(SentenceKV().decide(view), op=Op.PREFETCH) == []
