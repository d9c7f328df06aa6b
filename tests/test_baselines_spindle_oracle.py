"""SpindleKV and the oracle pin down their rules on constructed views; the oracle beats LRU / StreamingLLM on a
teacher-forced tiny-model run."""

import pytest
import torch

from agents.baselines.lru import LRU
from agents.baselines.oracle import AttentionTrace, Oracle, TraceRecorder
from agents.baselines.spindlekv import SpindleKV, pyramid_budgets
from agents.baselines.streaming_llm import StreamingLLM
from cache.controller import CacheView, Op, apply_decisions
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.runner import Runner
from cache.tiers import Tier
from tests.conftest import make_tiny_llama

# seen = 160: blocks 0..9 (block b starts at 16 b, so 160 − 16 b queries could see it); 0 and 9 are pinned,
# SpindleKV's 64-token window covers blocks 6..9
QUERIES = torch.tensor([160.0, 144, 128, 112, 96, 80, 64, 48, 32, 16])


@torch.no_grad()
def view_of(model, budget, duplicates=False):
    """A 160-token prefill. With ``duplicates``, on both layers: block 4's keys = block 2's (cosine 1), block 1's
    = block 8's + small noise (≈ 0.99), block 3's = block 7's + half block 5's (≈ 0.93)."""
    cache = PagedKVCache(model.config, CacheConfig())
    model(input_ids=torch.randint(2, 256, (1, 160), generator=torch.Generator().manual_seed(1)), cache=cache,
          use_cache=True)
    if duplicates:
        for layer in range(cache.num_layers):
            keys, physical = cache.device_pool(layer).keys, cache.tables.physical[layer]
            keys[physical[4]] = keys[physical[2]]
            noise = torch.randn(keys[physical[8]].shape, generator=torch.Generator().manual_seed(2))
            keys[physical[1]] = keys[physical[8]] + 0.02 * noise
            keys[physical[3]] = keys[physical[7]] + 0.5 * keys[physical[5]]
            cache.summarize_keys(layer, torch.arange(10))
    return cache, CacheView.from_cache(cache, budget)


def blocks(decisions, op, layer=0, ordered=False):
    out = [d.block for d in decisions if d.layer == layer and d.op == op]
    return out if ordered else sorted(out)


def set_mass(view, layer, normalised):
    """``acc_mass`` of blocks 1..5 from their normalised scores; the window blocks 6..8 get none."""
    view.acc_mass[layer] = 0.0
    view.acc_mass[layer, 1:6] = torch.tensor(normalised) * QUERIES[1:6]


def test_spindlekv_merges_similar_blocks_in_shallow_layers_and_evicts_by_normalised_mass(tiny_model):
    cache, view = view_of(tiny_model, [6, 6], duplicates=True)
    similarity = view.neighbour_similarity
    assert similarity[0, 2] > 0.999 and 0.98 < similarity[0, 1] < 0.999 and 0.9 < similarity[0, 3] < 0.98
    assert similarity[0, 5] < 0.9  # block 5 has no similar neighbour
    # layer 0 (shallow): raw mass would evict 4 and 5 (9.0, 9.6); normalised: 4 (0.094) and 3 (0.1)
    set_mass(view, 0, [0.2, 0.25, 0.1, 9.0 / 96, 0.12])
    # layer 1 (deep): normalised keeps block 5 (0.3); raw mass would keep block 1 (28.8 > 24)
    set_mass(view, 1, [0.2, 0.05, 0.15, 0.1, 0.3])
    decisions = SpindleKV().decide(view)
    # 2 ≡ 4 first (oldest of the tie); 4 then has no similar neighbour left; 1 ≈ 8 next; 3 (0.93) is below θ_K
    assert blocks(decisions, Op.MERGE, ordered=True) == [2, 1]
    assert blocks(decisions, Op.EVICT) == [3, 4]
    assert blocks(decisions, Op.MERGE, layer=1) == []  # the deep layer never merges, duplicates or not
    assert blocks(decisions, Op.EVICT, layer=1) == [1, 2, 3, 4]  # window blocks 6..8 kept despite no mass
    # a lower threshold lets block 3 (≈ 0.93 with block 7) merge too; one eviction is left
    loose = SpindleKV(key_threshold=0.9).decide(view)
    assert blocks(loose, Op.MERGE, ordered=True) == [2, 1, 3] and blocks(loose, Op.EVICT) == [4]
    # the merges are accepted by the cache and the budget is met
    apply_decisions(cache, decisions)
    assert cache.blocks_per_tier()["device"] == [6, 6]
    assert cache.blocks_per_tier()["dropped"] == [4, 4]


def test_pyramid_budgets_interpolate_linearly_and_never_exceed_the_view():
    # mean 8, β 20: 15.6, 10.53, 5.47, 0.4 → clipped to 8, floored to whole blocks and to the 2 pinned blocks
    assert pyramid_budgets([8] * 4, beta=20.0, floors=[2] * 4) == [8, 8, 5, 2]
    # mean 8, β 2: 12, 8, 4; each layer keeps at most its own budget
    assert pyramid_budgets([4, 8, 12], beta=2.0) == [4, 8, 4]
    assert pyramid_budgets([7], beta=20.0, floors=[2]) == [7]  # a single deep layer keeps its budget


def test_spindlekv_deep_layers_evict_by_score_within_the_pyramid(tiny_model):
    _, view = view_of(tiny_model, [6, 6], duplicates=True)
    set_mass(view, 0, [0.2, 0.25, 0.1, 9.0 / 96, 0.12])
    set_mass(view, 1, [0.2, 0.05, 0.15, 0.1, 0.3])
    controller = SpindleKV(shallow_fraction=0.0, beta=2.0)  # both layers deep: pyramid 9, 3 → 6, 3
    assert controller.layer_budgets(view) == [6, 3]
    assert SpindleKV().layer_budgets(view) == [6, 6]  # default: layer 0 shallow, one deep layer
    assert SpindleKV(shallow_fraction=0.0).layer_budgets(view) == [6, 2]  # β 20: 11.7, 0.3 → 6, pinned 2
    decisions = controller.decide(view)
    assert [d for d in decisions if d.op == Op.MERGE] == []
    assert blocks(decisions, Op.EVICT) == [1, 3, 4, 5]  # keeps block 2 (0.25)
    # layer 1 keeps 3 blocks: the pinned 0 and 9, then the window is cut oldest first, keeping block 8
    assert blocks(decisions, Op.EVICT, layer=1) == [1, 2, 3, 4, 5, 6, 7]


def hand_trace(seen):
    mass = torch.zeros(len(seen), 2, 10)
    mass[0, 0, 1] = 100.0  # the forward that reached 160 tokens: the past, ignored
    mass[1, 0] = torch.tensor([0, 0.0, 0.5, 0.1, 0.0, 0.3, 0.0, 0.2, 0.05, 0])
    mass[2, 0] = torch.tensor([0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.8, 0.0, 0.0, 0])
    mass[3, 0] = torch.tensor([0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0])
    return AttentionTrace(torch.tensor(seen), mass)


def test_oracle_evicts_the_blocks_with_least_attention_to_come(tiny_model):
    _, view = view_of(tiny_model, [5, 5])  # 8 evictable blocks per layer, 5 to go
    trace = hand_trace([160, 161, 162, 163])
    # to come: b1 0.1, b2 0.5, b3 0.1, b4 0.9, b5 0.3, b6 0.8, b7 0.2, b8 0.05 → keep 4, 6, 2
    decisions = Oracle(trace=trace).decide(view)
    assert blocks(decisions, Op.EVICT) == [1, 3, 5, 7, 8]
    assert blocks(decisions, Op.EVICT, layer=1) == [1, 2, 3, 4, 5]  # no attention to come: oldest first
    # horizon 1 token: only the next forward counts → keep 2 (0.5), 5 (0.3), 7 (0.2)
    assert blocks(Oracle(horizon=1, trace=trace).decide(view), Op.EVICT) == [1, 3, 4, 6, 8]
    # decision points must fall on the reference run's forward boundaries
    with pytest.raises(ValueError, match="no forward pass of the reference run ends at 160"):
        Oracle(trace=hand_trace([150, 170, 171, 172])).decide(view)
    # past the trace's end nothing is known: accumulated mass decides (as Oracle() without a trace)
    view.acc_mass[:] = torch.arange(10, 0, -1.0)  # newest blocks have the least
    expected = [4, 5, 6, 7, 8]
    assert blocks(Oracle(trace=hand_trace([100, 110, 120, 130])).decide(view), Op.EVICT) == expected
    with pytest.warns(UserWarning, match="Oracle.from_run"):
        assert blocks(Oracle().decide(view), Op.EVICT) == expected


def test_oracle_from_run_records_every_forward_and_drives_a_budgeted_run(tiny_model):
    ids = torch.randint(2, 256, (1, 100), generator=torch.Generator().manual_seed(3))
    oracle = Oracle.from_run(tiny_model, ids, max_new_tokens=12, prefill_chunk=32)
    trace = oracle.trace
    assert trace.seen.tolist() == [32, 64, 96, 100] + list(range(101, 112))
    # every query of every forward is recorded (stats_window raised to the chunk): mass per forward = queries
    queries = torch.tensor([32.0, 32, 32, 4] + [1.0] * 11)
    assert torch.allclose(trace.mass.sum(dim=2), queries[:, None].expand(-1, 2), atol=1e-4)
    full = Runner(tiny_model, prefill_chunk=32).run(ids, max_new_tokens=12)
    assert trace.tokens == full.new_tokens  # the full cache's greedy continuation
    result = Runner(tiny_model, controller=oracle, budget=3, prefill_chunk=32, decide_every=2).run(
        ids, max_new_tokens=12)
    assert result.fallbacks == 0 and result.operations["evict"] > 0
    assert max(result.blocks_per_tier["device"]) <= 3


@torch.no_grad()
def teacher_forced(model, ids, prompt_len, chunk, controller, budget):
    """Log-probs of ``ids[prompt_len:]`` fed one token a step after a chunked prefill, with a decision point
    after every forward (``budget`` None: the full cache)."""
    cache = PagedKVCache(model.config, CacheConfig(max_tokens=ids.shape[1], stats_window=chunk))
    full = [cache.max_blocks] * cache.num_layers

    def decision_point():
        apply_decisions(cache, controller.decide(CacheView.from_cache(cache, budget or full)))
        assert budget is None or cache.enforce_budget(budget) == 0

    for start in range(0, prompt_len, chunk):
        model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        decision_point()
    logprobs = []
    for t in range(prompt_len, ids.shape[1]):
        logits = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1].float()
        logprobs.append(torch.log_softmax(logits, dim=-1))
        decision_point()
    assert budget is None or cache.tables.count_in(0, Tier.DEVICE) <= budget[0]
    return torch.stack(logprobs)


def test_oracle_error_is_below_lru_and_streaming_llm_on_a_teacher_forced_run():
    """Tiny random Llama with queries and keys scaled ×15 so attention is peaked (unscaled, it is near uniform
    and every policy ties); 128-token prompt in 32-token chunks, 64 teacher-forced tokens, 5 blocks a layer.
    Measured: KL 0.0076 (oracle) vs 0.0095 (LRU), 0.0097 (StreamingLLM)."""
    model = make_tiny_llama(seed=0)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data.mul_(15.0)
        layer.self_attn.k_proj.weight.data.mul_(15.0)
    ids = torch.randint(2, 256, (1, 192), generator=torch.Generator().manual_seed(0))
    recorder = TraceRecorder()
    full = teacher_forced(model, ids, 128, 32, recorder, None)
    kl = {}
    for name, controller in (("oracle", Oracle(trace=recorder.trace())), ("lru", LRU()),
                             ("streamingllm", StreamingLLM())):
        approx = teacher_forced(model, ids, 128, 32, controller, [5, 5])
        kl[name] = (full.exp() * (full - approx)).sum(dim=-1).mean().item()
    print("KL vs full cache:", kl)
    assert kl["oracle"] < 0.9 * min(kl["lru"], kl["streamingllm"])
