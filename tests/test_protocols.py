"""The evaluation protocols of the runner on the tiny random Llama: where the decisions fall, what the budget
counts, when the first answer token is computed, multi-turn runs and shared dense prefills."""

import math

import pytest
import torch

from cache.controller import Decision, Op
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.runner import Prompt, Runner
from cache.tiers import Tier

BLOCK = 8


def ids_of(n, seed=0):
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Recorder:
    """Records (phase, seen, device blocks per layer, budget per layer, question read) at every decision;
    ``act(view)`` returns decisions."""

    def __init__(self, act=None):
        self.calls, self.act = [], act

    def decide(self, view):
        self.calls.append((view.phase, view.seen, view.device_blocks().tolist(), view.budget_blocks.tolist(),
                           view.question_read))
        return self.act(view) if self.act else []


def evict_unpinned_at(phase):
    def act(view):
        if view.phase != phase:
            return []
        return [Decision(layer, block, Op.EVICT) for layer in range(view.num_layers)
                for block in range(view.num_blocks)
                if view.tier[layer, block] == Tier.DEVICE and not view.pinned[layer, block]]
    return act


def config(**kw):
    return CacheConfig(block_size=BLOCK, **kw)


@torch.no_grad()
def manual_logits(model, ids, chunks, evict_before_last=False):
    """Logits of the last prompt token: ``ids[:-1]`` prefilled in ``chunks`` (optionally evicting every
    unpinned block), then the last token alone."""
    cache = PagedKVCache(model.config, config(max_tokens=len(ids) + 8))
    for a, b in chunks:
        model(input_ids=torch.tensor([ids[a:b]]), cache=cache, use_cache=True)
    if evict_before_last:
        for layer in range(cache.num_layers):
            for block in range(cache.num_logical_blocks(layer)):
                if cache.tables.tier[layer, block] == Tier.DEVICE and not cache.is_pinned(layer, block):
                    cache.evict(layer, block)
    return model(input_ids=torch.tensor([ids[-1:]]), cache=cache, use_cache=True).logits[0, -1].float()


def test_streaming_decides_after_the_question_and_before_the_first_answer_token(tiny_model):
    ids = ids_of(60)
    prompt = Prompt(ids, context_end=40)  # context 0..39, question 40..59
    recorder = Recorder(evict_unpinned_at("question"))
    result = Runner(tiny_model, cache_config=config(), controller=recorder, budget=64, prefill_chunk=16).run(
        prompt, max_new_tokens=3, keep_logits=True, stop_at_eos=False)
    phases = [(phase, seen) for phase, seen, *_ in recorder.calls]
    # context chunks never straddle the question; the chunk that ends the question is its decision point
    assert phases[:5] == [("prefill", 16), ("prefill", 32), ("prefill", 40), ("prefill", 56), ("question", 59)]
    assert all(phase == "decode" for phase, _ in phases[5:])
    # the view says whether the question has been read: not in the context's chunks, from its first chunk on
    assert [call[4] for call in recorder.calls[:5]] == [False, False, False, True, True]
    assert all(call[4] for call in recorder.calls[5:])
    # the first answer token comes from the cache as decided: the question's evictions are in its logits
    decided = manual_logits(tiny_model, ids, [(0, 16), (16, 32), (32, 40), (40, 56), (56, 59)], evict_before_last=True)
    assert torch.allclose(result.logits[0], decided, atol=1e-5)
    # negative control: the old order (first answer token from the last prefill chunk, before the decision)
    with torch.no_grad():
        cache = PagedKVCache(tiny_model.config, config(max_tokens=80))
        old = tiny_model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1].float()
    assert not torch.allclose(result.logits[0], old, atol=1e-3)


def test_budget_is_a_fraction_of_the_context(tiny_model):
    prompt = Prompt(ids_of(100), context_end=80)
    result = Runner(tiny_model, cache_config=config(), controller=Recorder(), budget=0.25, prefill_chunk=16).run(
        prompt, max_new_tokens=30, stop_at_eos=False)
    assert result.budget_blocks == [math.ceil(0.25 * 80 / BLOCK)] * 2
    assert result.context_tokens == 80
    assert max(result.blocks_per_tier["device"]) <= result.budget_blocks[0]  # streaming: bounded


@pytest.mark.parametrize("protocol", ["oneshot", "oneshot-question"])
def test_oneshot_one_decision_then_the_cache_grows(tiny_model, protocol):
    ids = ids_of(90)
    prompt = Prompt(ids, context_end=70)
    recorder = Recorder()
    runner = Runner(tiny_model, cache_config=config(), controller=recorder, budget=0.25, prefill_chunk=16,
                    protocol=protocol)
    result = runner.run(prompt, max_new_tokens=24, stop_at_eos=False)
    dense_end = 70 if protocol == "oneshot" else 89
    assert [(phase, seen) for phase, seen, *_ in recorder.calls] == [("compress", dense_end)]
    assert recorder.calls[0][4] == (protocol == "oneshot-question")  # kvpress's pipeline compresses question-blind
    budget = math.ceil(0.25 * 70 / BLOCK)
    assert recorder.calls[0][3] == [budget, budget]
    assert result.fallbacks > 0  # the recorder decides nothing: the fallback meets the budget at the decision
    # after the one decision the question and the answer grow the cache past the budget
    assert max(result.blocks_per_tier["device"]) > budget
    fixed = Runner(tiny_model, cache_config=config(), controller=Recorder(), budget=0.25, prefill_chunk=16,
                   protocol=protocol, decode_budget="fixed").run(prompt, max_new_tokens=24, stop_at_eos=False)
    assert max(fixed.blocks_per_tier["device"]) <= budget


def test_oneshot_dense_prefill_is_aligned_to_its_end(tiny_model):
    """The last dense chunk holds the last ``stats_window`` queries (SnapKV's window at the end of the prompt)."""
    recorder = Recorder()
    Runner(tiny_model, cache_config=config(stats_window=16), controller=recorder, budget=0.5, prefill_chunk=16,
           protocol="oneshot-question").run(Prompt(ids_of(75)), max_new_tokens=2)
    assert recorder.calls[0][:2] == ("compress", 74)


def test_a_prefetch_at_the_question_point_changes_the_first_answer_token(tiny_model):
    ids = ids_of(64, seed=2)
    prompt = Prompt(ids, context_end=48)

    def act(prefetch):
        def decide(view):
            if view.phase == "prefill" and view.seen == 32:  # block 1 (tokens 8..15) to the host tier
                return [Decision(layer, 1, Op.EVICT) for layer in range(view.num_layers)]
            if view.phase == "question" and prefetch:
                return [Decision(layer, 1, Op.PREFETCH) for layer in range(view.num_layers)]
            return []
        return decide

    results = {}
    for prefetch in (False, True):
        runner = Runner(tiny_model, cache_config=config(host_blocks=4), controller=Recorder(act(prefetch)),
                        budget=64, prefill_chunk=16)
        results[prefetch] = runner.run(prompt, max_new_tokens=2, keep_logits=True, stop_at_eos=False)
    assert results[True].operations["prefetch"] == 2 and results[False].operations.get("prefetch", 0) == 0
    assert not torch.allclose(results[True].logits[0], results[False].logits[0], atol=1e-4)
    assert results[True].blocks_per_tier["host"] == [0, 0] and results[False].blocks_per_tier["host"] == [1, 1]


def test_multiturn_answers_each_turn_before_the_next_under_one_budget(tiny_model):
    ids, turns = ids_of(70), [ids_of(6, seed=5), ids_of(9, seed=6)]
    prompt = Prompt(ids, context_end=60, turns=turns)
    recorder = Recorder()
    result = Runner(tiny_model, cache_config=config(), controller=recorder, budget=0.25, prefill_chunk=16,
                    protocol="multiturn").run(prompt, max_new_tokens=5, stop_at_eos=False, keep_logits=True)
    assert [len(t) for t in result.turn_tokens] == [5, 5, 5] and len(result.turn_logits) == 3
    questions = [seen for phase, seen, *_ in recorder.calls if phase == "question"]
    # turn 2 arrives after answer 1 (5 tokens, the last one fed with the question): 70 + 5 + 6 - 1
    assert questions == [69, 69 + 1 + 5 + 5, 69 + 1 + 5 + 5 + 1 + 5 + 8]
    budget = math.ceil(0.25 * 60 / BLOCK)
    # between two decisions the cache gains at most one chunk (+ a partly filled block); each decision restores it
    assert all(max(blocks) <= budget + 16 // BLOCK + 1 for _, _, blocks, *_ in recorder.calls)
    assert max(result.blocks_per_tier["device"]) <= budget
    with pytest.raises(ValueError, match="--protocol multiturn"):
        Runner(tiny_model, cache_config=config(), budget=0.25).run(prompt, max_new_tokens=2)


@pytest.mark.parametrize("protocol", ["oneshot", "oneshot-question"])
def test_a_shared_dense_prefill_gives_the_same_runs(tiny_model, protocol):
    from agents.registry import make_controller

    prompt = Prompt(ids_of(90, seed=9), context_end=72)
    shared = Runner(tiny_model, cache_config=config(), prefill_chunk=16, protocol=protocol).dense_prefill(prompt, 12)
    for spec in ("h2o", "tova", "streamingllm"):
        runs = []
        for use in (None, shared):
            runner = Runner(tiny_model, cache_config=config(host_blocks=8), controller=make_controller(spec),
                            budget=0.25, prefill_chunk=16, protocol=protocol)
            runs.append(runner.run(prompt, max_new_tokens=12, keep_logits=True, stop_at_eos=False, shared=use))
        assert runs[0].new_tokens == runs[1].new_tokens
        assert torch.allclose(torch.stack(runs[0].logits), torch.stack(runs[1].logits), atol=1e-5)
        assert runs[0].operations == runs[1].operations
    # every run worked on its own copy: the shared cache still holds every block on the device
    assert shared.cache.blocks_per_tier()["device"] == [math.ceil(shared.dense_end / BLOCK)] * 2
    with pytest.raises(ValueError, match="another prompt"):
        Runner(tiny_model, cache_config=config(), budget=0.25, protocol=protocol).run(
            Prompt(ids_of(90, seed=10), context_end=72), max_new_tokens=12, shared=shared)


def test_clone_is_independent_and_continues_identically(tiny_model):
    cache = PagedKVCache(tiny_model.config, config(max_tokens=64))
    with torch.no_grad():
        tiny_model(input_ids=torch.tensor([ids_of(40)]), cache=cache, use_cache=True)
        copy = cache.clone(host_blocks=4)
        step = torch.tensor([[7]])
        a = tiny_model(input_ids=step, cache=cache, use_cache=True).logits
        b = tiny_model(input_ids=step, cache=copy, use_cache=True).logits
        assert torch.allclose(a, b, atol=1e-6)
        copy.evict(0, 2)  # goes to the copy's own host tier
        assert copy.tables.tier[0, 2] == Tier.HOST and cache.tables.tier[0, 2] == Tier.DEVICE
        assert torch.equal(cache.stats.acc_mass_heads[:, :, :6], cache.stats.acc_mass_heads[:, :, :6])
        c = tiny_model(input_ids=step, cache=cache, use_cache=True).logits
        d = tiny_model(input_ids=step, cache=copy, use_cache=True).logits
        assert not torch.allclose(c, d, atol=1e-4)
    with pytest.raises(ValueError, match="offloaded"):
        copy.clone()


@pytest.mark.parametrize("protocol", ["oneshot", "oneshot-question"])
def test_a_multi_turn_prompt_under_oneshot_is_compressed_once_then_answered_turn_by_turn(tiny_model, protocol):
    ids, turns = ids_of(70), [ids_of(6, seed=5), ids_of(9, seed=6)]
    prompt = Prompt(ids, context_end=60, turns=turns)
    recorder = Recorder(evict_unpinned_at("compress"))

    def runner(controller, **kwargs):
        return Runner(tiny_model, cache_config=config(), controller=controller, budget=0.25, prefill_chunk=16,
                      protocol=protocol, **kwargs)

    result = runner(recorder).run(prompt, max_new_tokens=5, stop_at_eos=False, keep_logits=True)
    assert [len(t) for t in result.turn_tokens] == [5, 5, 5] and len(result.turn_logits) == 3
    assert [call[0] for call in recorder.calls] == ["compress"]  # the cache grows after it: no other decision
    # the first turn is the single-turn run of the same prompt (later turns cannot change it)
    single = runner(Recorder(evict_unpinned_at("compress"))).run(Prompt(ids, context_end=60), max_new_tokens=5,
                                                                  stop_at_eos=False)
    assert result.turn_tokens[0] == single.new_tokens
    # a shared dense prefill gives the same turns
    shared = runner(None).dense_prefill(prompt, 5)
    again = runner(Recorder(evict_unpinned_at("compress"))).run(prompt, max_new_tokens=5, stop_at_eos=False,
                                                                 shared=shared)
    assert again.turn_tokens == result.turn_tokens
    # decode_budget="fixed": the budget holds, and every later turn's question is a decision point
    fixed_recorder = Recorder()
    fixed = runner(fixed_recorder, decode_budget="fixed").run(prompt, max_new_tokens=5, stop_at_eos=False)
    assert [phase for phase, *_ in fixed_recorder.calls].count("question") == 2
    assert max(fixed.blocks_per_tier["device"]) <= math.ceil(0.25 * 60 / BLOCK)
    # negative control: the streamed protocol still refuses a multi-turn prompt
    with pytest.raises(ValueError, match="--protocol multiturn"):
        Runner(tiny_model, cache_config=config(), budget=0.25, protocol="streaming").run(prompt, max_new_tokens=2)


class LayerOneFirst:
    """Scores every block of layer 0 above every block of layer 1 and evicts the lowest (``evict_lowest``);
    records (phase, total budget, allocation, device blocks) at each decision."""

    def __init__(self):
        self.calls = []

    def decide(self, view):
        from agents.baselines.base import evict_lowest

        self.calls.append((view.phase, view.total_budget, view.budget_blocks.tolist(), view.device_blocks().tolist()))
        scores = torch.arange(view.num_blocks, dtype=torch.float32).repeat(view.num_layers, 1)
        scores[0] += 1000.0
        return evict_lowest(view, scores)


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_budget_scope_global_lets_scores_choose_each_layers_share(tiny_model, scope):
    """Global scope (kvpress's layerwise=False): only the total over layers holds, so the lowest scores over all
    layers go; layer scope (the negative control) keeps the same share in every layer. Under a fixed decode
    budget the allocation the controller chose carries over to the later decisions, and the total never grows."""
    ids = ids_of(200)
    controller = LayerOneFirst()
    result = Runner(tiny_model, cache_config=config(), controller=controller, budget=0.25, prefill_chunk=16,
                    protocol="oneshot-question", decode_budget="fixed", decide_every=4, budget_scope=scope).run(
        Prompt(ids), max_new_tokens=24, stop_at_eos=False)
    budget = math.ceil(0.25 * 200 / BLOCK)
    phase, total, allocation, _ = controller.calls[0]
    assert phase == "compress" and allocation == [budget, budget]
    assert result.fallbacks == 0
    device = result.blocks_per_tier["device"]
    if scope == "layer":
        assert total is None and device == [budget, budget]
        return
    assert total == 2 * budget
    pinned = CacheConfig().sink_blocks + 1  # the sink blocks and the newest block
    after = controller.calls[1]
    assert after[2][1] <= pinned + 1 and after[2][0] + after[2][1] == 2 * budget  # layer 1 gave its blocks to layer 0
    assert all(sum(call[2]) <= 2 * budget for call in controller.calls[1:])
    assert sum(device) <= 2 * budget and device[0] > device[1]


def test_budget_scope_defaults_to_the_controllers_own(tiny_model):
    from agents.baselines.kvzip import KVzip

    assert Runner(tiny_model, controller=KVzip(), budget=0.25).budget_scope == "global"  # kvpress's default
    assert Runner(tiny_model, controller=KVzip(layerwise=True), budget=0.25).budget_scope == "layer"
    assert Runner(tiny_model, controller=KVzip(), budget=0.25, budget_scope="layer").budget_scope == "layer"
    assert Runner(tiny_model, controller=LayerOneFirst(), budget=0.25).budget_scope == "layer"
    with pytest.raises(ValueError, match="--budget-scope 'both'"):
        Runner(tiny_model, controller=LayerOneFirst(), budget=0.25, budget_scope="both")
