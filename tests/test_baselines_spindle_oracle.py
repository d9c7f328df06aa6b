"""The oracle pins down its rule on constructed views and beats LRU / StreamingLLM on a teacher-forced tiny-model
run (SpindleKV's rules are in ``test_baselines_paper_rules.py``)."""

from pathlib import Path

import pytest
import torch

from agents.baselines.lru import LRU
from agents.baselines.oracle import AttentionTrace, Oracle, TraceRecorder
from agents.baselines.streaming_llm import StreamingLLM
from cache.controller import CacheView, Op, apply_decisions
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.runner import Runner
from cache.tiers import Tier
from tests.conftest import make_tiny_llama


@torch.no_grad()
def view_of(model, budget):
    """A 160-token prefill (blocks 0..9)."""
    cache = PagedKVCache(model.config, CacheConfig())
    model(input_ids=torch.randint(2, 256, (1, 160), generator=torch.Generator().manual_seed(1)), cache=cache,
          use_cache=True)
    return cache, CacheView.from_cache(cache, budget)


def blocks(decisions, op, layer=0, ordered=False):
    out = [d.block for d in decisions if d.layer == layer and d.op == op]
    return out if ordered else sorted(out)


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
    # the last prompt token is fed on its own, after the question's decision point
    assert trace.seen.tolist() == [32, 64, 96, 99, 100] + list(range(101, 112))
    # every query of every forward is recorded (stats_window raised to the chunk): mass per forward = queries
    queries = torch.tensor([32.0, 32, 32, 3, 1] + [1.0] * 11)
    assert torch.allclose(trace.mass.sum(dim=2), queries[:, None].expand(-1, 2), atol=1e-4)
    full = Runner(tiny_model, prefill_chunk=32).run(ids, max_new_tokens=12)
    assert trace.tokens == full.new_tokens  # the full cache's greedy continuation
    result = Runner(tiny_model, controller=oracle, budget=3, prefill_chunk=32, decide_every=2).run(
        ids, max_new_tokens=12)
    assert result.fallbacks == 0 and result.operations["evict"] > 0
    assert max(result.blocks_per_tier["device"]) <= 3


def test_prefetching_oracle_keeps_what_the_next_queries_attend(tiny_model):
    _, view = view_of(tiny_model, [5, 5])  # 3 places per layer besides the sink and the newest block
    trace = hand_trace([160, 161, 162, 163])
    # the next token attends b2 0.5, b5 0.3, b7 0.2 (b3 0.1, b8 0.05): those three stay, whatever comes later
    decisions = Oracle(trace=trace, prefetch=True, window=1).decide(view)  # a prefill view
    assert blocks(decisions, Op.EVICT) == [1, 3, 4, 6, 8]
    # the window reaching the rest of the run ranks by all of it, as the evicting oracle does
    assert blocks(Oracle(trace=trace, prefetch=True, window=8).decide(view), Op.EVICT) == [1, 3, 5, 7, 8]


def test_prefetching_oracle_brings_offloaded_blocks_back(tiny_model):
    """With a host tier the prefetching oracle moves blocks back to the device; the evicting oracle (the negative
    control) never does; both hold the budget without the fallback."""
    ids = torch.randint(2, 256, (1, 160), generator=torch.Generator().manual_seed(4))
    trace = Oracle.from_run(tiny_model, ids, max_new_tokens=16, prefill_chunk=32).trace
    results = {}
    for prefetch in (False, True):
        runner = Runner(tiny_model, None, CacheConfig(host_blocks=16), controller=Oracle(trace=trace, prefetch=prefetch),
                        budget=4, prefill_chunk=32, decide_every=2)
        results[prefetch] = runner.run(ids, max_new_tokens=16)
    for result in results.values():
        assert result.fallbacks == 0 and max(result.blocks_per_tier["device"]) <= 4
    assert results[False].operations["prefetch"] == 0
    assert results[True].operations["prefetch"] > 0
    # the cost-aware oracle: a hysteresis moves fewer blocks than the plain top-b (which moves the most)
    steady = Runner(tiny_model, None, CacheConfig(host_blocks=16), controller=Oracle(trace=trace, prefetch=True, stay=2.0),
                    budget=4, prefill_chunk=32, decide_every=2).run(ids, max_new_tokens=16)
    assert steady.fallbacks == 0 and max(steady.blocks_per_tier["device"]) <= 4
    moved = {name: r.operations["prefetch"] + r.operations["evict"] for name, r in (("plain", results[True]), ("steady", steady))}
    assert moved["steady"] < moved["plain"]
    with pytest.raises(ValueError, match="stay"):
        Oracle(prefetch=True, stay=-1.0)


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


def test_prefill_ranker_makes_the_prefills_decisions_and_the_oracle_the_rest(tiny_model):
    """``prefill_ranker``: a diagnostic oracle whose prefill decisions are the shipped ranker's (``stay=2``); from
    the question on it is the prefetching oracle (with ``ranker_phases``: from the phases it does not name).
    Negative control: the oracle's own prefill (and question) decision differs."""
    import numpy as np

    from agents.policy_file import PolicyFileError
    from agents.ranker.controller import RankerController

    path = str(Path(__file__).resolve().parents[1] / "policies" / "ranker_smollm2.pt")
    cache, prefill = view_of(tiny_model, [5, 5])
    trace = hand_trace([160, 161, 162, 163])
    mixed = Oracle(trace=trace, prefetch=True, window=1, prefill_ranker=path)
    oracle = Oracle(trace=trace, prefetch=True, window=1)
    assert np.array_equal(mixed.decide(prefill).device, RankerController(path, stay=2.0).decide(prefill).device)
    assert not np.array_equal(oracle.decide(prefill).device, mixed.decide(prefill).device)
    question = CacheView.from_cache(cache, [5, 5], phase="question")
    assert np.array_equal(mixed.decide(question).device, oracle.decide(question).device)
    # ranker_phases: the ranker also decides the question's decision point (the oracle only the answer's)
    later = Oracle(trace=trace, prefetch=True, window=1, prefill_ranker=path, ranker_phases="prefill+question")
    ranker = RankerController(path, stay=2.0, question_stay=0.0)
    assert np.array_equal(later.decide(question).device, ranker.decide(question).device)
    assert not np.array_equal(later.decide(question).device, oracle.decide(question).device)
    decode = CacheView.from_cache(cache, [5, 5], phase="decode")
    assert np.array_equal(later.decide(decode).device, oracle.decide(decode).device)
    with pytest.raises(ValueError, match="ranker_phases"):
        Oracle(prefetch=True, ranker_phases="prefill+answer")
    with pytest.raises(PolicyFileError, match="does not exist"):
        Oracle(prefetch=True, prefill_ranker="policies/missing.pt")
