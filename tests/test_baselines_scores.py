"""H2O, SnapKV and TOVA pin down their papers' rules on constructed views: a real cache from the tiny model,
with chosen attention statistics written over the view's per-head rows (every head the same unless said)."""

import pytest
import torch

from agents.baselines.h2o import H2O
from agents.baselines.snapkv import SnapKV, pool_block_scores
from agents.baselines.streaming_llm import StreamingLLM
from agents.baselines.tova import TOVA
from cache.controller import CacheView, Op, apply_decisions
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.runner import Runner
from cache.tiers import Tier


@torch.no_grad()
def prefilled(model, tokens=160):
    cache = PagedKVCache(model.config, CacheConfig())
    model(input_ids=torch.randint(2, 256, (1, tokens), generator=torch.Generator().manual_seed(1)), cache=cache,
          use_cache=True)
    return cache


@torch.no_grad()
def decode_one(model, cache):
    model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True)


def evicted(decisions, layer=0):
    assert all(d.op == Op.EVICT for d in decisions)
    return sorted(d.block for d in decisions if d.layer == layer)


# ------------------------------------------------------------------------------------------------ H2O
def test_h2o_keeps_the_heaviest_blocks_and_the_recent_window(tiny_model):
    view = CacheView.from_cache(prefilled(tiny_model), [6, 6])  # blocks 0..9
    view.acc_mass_heads[0] = torch.tensor([50, 1, 9, 2, 8, 3, 0.5, 0.1, 0.2, 0.3])
    # budget 6 split 50:50: recent window = blocks 7, 8, 9 (kept although lightest); heavy = sink 0 + the two
    # heaviest of 1..6 (2: 9, 4: 8)
    assert evicted(H2O().decide(view)) == [1, 3, 5, 6]
    # negative check: recency alone (StreamingLLM) keeps 5..9 instead
    assert evicted(StreamingLLM().decide(view)) == [1, 2, 3, 4]


def test_h2o_ratios_split_the_budget(tiny_model):
    assert [H2O().recent_window(b) for b in (2, 5, 6, 7)] == [1, 3, 3, 4]  # half up
    view = CacheView.from_cache(prefilled(tiny_model), [6, 6])
    view.acc_mass_heads[0] = torch.tensor([50, 1, 9, 2, 8, 3, 0.5, 0.1, 0.2, 0.3])
    # 3:1 -> recent window of round(1.5) = 2 blocks (8, 9); heavy = sink + 3 heaviest of 1..7 (2, 4, 5)
    assert evicted(H2O(heavy_ratio=0.3, recent_ratio=0.1).decide(view)) == [1, 3, 6, 7]
    # no recent share: only the pinned newest block; heavy = sink + 4 heaviest of 1..8 (2, 4, 5, 3)
    assert evicted(H2O(recent_ratio=0.0).decide(view)) == [1, 6, 7, 8]
    with pytest.raises(ValueError, match="ratios"):
        H2O(heavy_ratio=0.0, recent_ratio=0.0)


# ------------------------------------------------------------------------------------------------ SnapKV
def test_snapkv_pooling_maps_the_token_kernel_onto_blocks():
    mass = torch.tensor([[10, 0, 3, 0, 2, 12.0]])
    full = torch.full((1, 6), 16)
    # kernel 1: no smoothing
    assert pool_block_scores(mass, full, 16, 1, "maxpool").tolist() == mass.tolist()
    # kernel 7: a block lends its density to the 3 edge tokens of a lighter neighbour;
    # block 4 = 10 * 2/16 + 3 * 2/16 + 3 * 12/16 = 3.875; block 1 = 3 * 10/16 = 1.875 + 0.5625 (from block 2)
    pooled = pool_block_scores(mass, full, 16, 7, "maxpool")
    assert pooled[0].tolist() == pytest.approx([10, 2.4375, 3.0, 0.9375, 3.875, 12.0])


def snapkv_scenario(tiny_model):
    """160 prompt tokens (blocks 0..9), one forward: its last 64 queries (blocks 6..9) are the window."""
    cache = prefilled(tiny_model)
    view = CacheView.from_cache(cache, [7, 7])
    assert view.last_mass.sum(dim=1).tolist() == pytest.approx([64, 64], abs=1e-3)
    # layer 0: block 4 is weak (2) but borders the heavy block 5 (12); block 2 (3) is isolated.
    # Window masses are tiny (but keep the sum = 64 queries) so they would go if not protected.
    view.last_mass_heads[0] = torch.tensor([10, 0, 3, 0, 2, 12, 0.1, 0.2, 0.3, 36.4])
    # layer 1: the window's first block (6) is heavy; it must not lend its mass to block 5 (excluded from pooling)
    view.last_mass_heads[1] = torch.tensor([10, 0, 3, 0, 2, 0.5, 46.5, 1, 0.5, 0.5])
    return cache, view


def test_snapkv_pooling_rescues_a_neighbour_and_keeps_the_window(tiny_model):
    _, view = snapkv_scenario(tiny_model)
    # budget 7 = sink 0 + window 6..9 + 2 prefix blocks. Pooled (k=7, max): 1: 2.44, 2: 3.0, 3: 0.94, 4: 3.875, 5: 12
    assert evicted(SnapKV().decide(view)) == [1, 2, 3]  # block 4 rescued by block 5, block 2 evicted
    assert evicted(SnapKV(kernel_size=1).decide(view)) == [1, 3, 4]  # without pooling: by raw mass
    # layer 1 pooled: 1: 2.44, 2: 3.0, 3: 0.94, 4: 2.0, 5: 0.78 (would be ~9.5 if the window were pooled in)
    assert evicted(SnapKV().decide(view), layer=1) == [3, 4, 5]


def test_snapkv_window_is_the_last_forward_queries(tiny_model):
    _, view = snapkv_scenario(tiny_model)
    # a 20-query forward: the window is the last 20 tokens = blocks 8, 9; budget 7 keeps 0, 8, 9 + top 4 of 1..7
    view.forward_queries = 20
    view.last_mass_heads[:] = torch.tensor([5, 0.1, 4, 0.2, 3, 0.3, 2, 0.4, 0.5, 4.5])
    assert evicted(SnapKV(kernel_size=1).decide(view)) == [1, 3, 5]
    # through the runner: 160 tokens in chunks of 64, 64, 32; the last chunk's 32 queries = blocks 8, 9 survive
    # whatever their mass, as well as the sink; budget 4 leaves one prefix block
    result = Runner(tiny_model, controller=SnapKV(), budget=4, prefill_chunk=64).run(
        torch.randint(2, 256, (1, 160), generator=torch.Generator().manual_seed(3)), max_new_tokens=1)
    assert result.fallbacks == 0
    for layer in range(2):
        on_device = torch.nonzero(result.cache.tables.tier[layer, :10] == Tier.DEVICE).flatten().tolist()
        assert len(on_device) == 4 and on_device[0] == 0 and on_device[-2:] == [8, 9]


def test_snapkv_decodes_by_prefill_scores_then_oldest_generated(tiny_model):
    controller = SnapKV()
    cache, view = snapkv_scenario(tiny_model)
    apply_decisions(cache, controller.decide(view))  # prefill: layer 0 keeps 0, 4, 5, 6..9; layer 1 keeps 0, 1, 2
    decode_one(tiny_model, cache)  # position 160 opens block 10: one block over budget
    view = CacheView.from_cache(cache, [7, 7], phase="decode")
    assert view.last_mass.sum(dim=1).tolist() == pytest.approx([1, 1], abs=1e-4)
    view.last_mass_heads[0] = torch.tensor([0.5, 0, 0, 0, 0.4, 0.01, 0.01, 0.01, 0.01, 0.01, 0.05])  # ignored
    # the lowest prefill score among prompt blocks goes first, whatever the current query says
    assert evicted(controller.decide(view)) == [4]
    assert evicted(controller.decide(view), layer=1) == [1]
    # past the prompt blocks, the window and generated blocks go oldest first (a tighter budget shows it)
    tight = CacheView.from_cache(cache, [5, 5], phase="decode")
    assert evicted(controller.decide(tight)) == [4, 5, 6]
    assert evicted(controller.decide(tight), layer=1) == [1, 2, 6]


def test_snapkv_resets_on_a_new_run(tiny_model):
    controller = SnapKV()
    _, view = snapkv_scenario(tiny_model)
    controller.decide(view)
    cache = prefilled(tiny_model, tokens=80)  # a new, shorter run: blocks 0..4, then block 5 by decoding
    decode_one(tiny_model, cache)
    view = CacheView.from_cache(cache, [4, 4], phase="decode")
    # no prefill scores of this run were seen: all blocks count as window/generated -> oldest first
    # (the stale scores of the first run would have picked 3 and 1)
    assert evicted(controller.decide(view)) == [1, 2]


# ------------------------------------------------------------------------------------------------ TOVA
def test_tova_evicts_the_lowest_current_query_blocks(tiny_model):
    cache = prefilled(tiny_model)
    view = CacheView.from_cache(cache, [5, 5])
    view.last_query_heads[0] = torch.tensor([5, 0.2, 3, 0.1, 4, 0.3, 2, 0.4, 1, 0.05])
    view.acc_mass_heads[0] = torch.tensor([5, 9, 1, 8, 2, 7, 3, 6, 4, 5.0])  # opposite order: TOVA ignores it
    # 5 of 1..8 go; the newest block 9 is pinned although it scores lowest
    assert evicted(TOVA().decide(view)) == [1, 3, 5, 7, 8]
    # negative check: H2O ranks by accumulated attention and keeps the recent window 7..9
    assert evicted(H2O().decide(view)) == [2, 3, 4, 5, 6]
    # in a decode step the view's last_mass is that step's query alone
    decode_one(tiny_model, cache)
    view = CacheView.from_cache(cache, [5, 5], phase="decode")
    order = torch.argsort(torch.where(view.pinned[1], float("inf"), view.last_mass[1]), stable=True)
    assert evicted(TOVA().decide(view), layer=1) == sorted(order[:6].tolist())
