"""Lookahead (``agents.baselines.lookahead``): the drafted tokens' queries are the ones the cache itself computes when
it decodes those tokens (reference: the cache's own forwards, nothing offloaded), and the ranker uses them only at
the answer's decision points."""

import numpy as np
import pytest
import torch

import agents.baselines.lookahead as lookahead
from agents.registry import BASELINES, make_controller
from cache.controller import CacheView, Decision, Op, apply_decisions
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.ranking import keep_top
from cache.runner import Runner
from cache.tiers import Tier

DRAFT = 3


@torch.no_grad()
def decode_view(model, tokens=100, **config):
    """A cache after a prompt of ``tokens`` and one decode step, and the decision view of that step."""
    cache = PagedKVCache(model.config, CacheConfig(**config))
    ids = torch.randint(2, 256, (1, tokens), generator=torch.Generator().manual_seed(5)).tolist()[0]
    logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
    ids.append(int(logits.argmax()))
    logits = model(input_ids=torch.tensor([ids[-1:]]), cache=cache, use_cache=True).logits[0, -1]
    view = CacheView.from_cache(cache, [4, 4], phase="decode", model=model, token_ids=torch.tensor(ids))
    return cache, view, ids, logits


@torch.no_grad()
def test_drafted_queries_are_the_queries_of_the_greedy_continuation(tiny_model, monkeypatch):
    cache, view, ids, logits = decode_view(tiny_model)
    queries, first = lookahead.draft_queries(view, DRAFT)
    assert first == len(ids) - 1 and queries[0].shape == (tiny_model.config.num_attention_heads, DRAFT,
                                                           tiny_model.config.head_dim)
    expected = [[cache.last_query[layer].float().clone()] for layer in range(2)]  # the newest token's, fed again
    for _ in range(DRAFT - 1):  # the reference: the cache itself decodes the greedy continuation
        token = int(logits.argmax())
        logits = tiny_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
        for layer in range(2):
            expected[layer].append(cache.last_query[layer].float().clone())
    for layer in range(2):
        assert torch.allclose(queries[layer], torch.stack(expected[layer], dim=1), atol=1e-5), layer
    # negative control: a copy that keeps the newest token (fed twice) changes layer 1's queries
    real_copy = lookahead.resident_copy
    monkeypatch.setattr(lookahead, "resident_copy", lambda view, extra, drop_newest=0, chosen=None: real_copy(view, extra))
    doubled, _ = lookahead.draft_queries(view, DRAFT)
    assert not torch.allclose(doubled[1], torch.stack(expected[1], dim=1), atol=1e-3)


@torch.no_grad()
def test_lookahead_share_of_the_newest_token_is_the_attention_its_forward_paid(tiny_model):
    """Nothing offloaded: the first drafted query is the newest token's, so its share over the blocks is the
    attention the decode step computed (``window_attention_share``, itself checked against the forward)."""
    _, view, _, _ = decode_view(tiny_model)
    queries, first = lookahead.draft_queries(view, 1)
    assert torch.allclose(view.attention_share(queries, first), view.window_attention_share, atol=1e-5)


def offload(cache, model, ids, blocks=(2, 3)):
    """Send ``blocks`` of both layers to the host; the decode view after it."""
    apply_decisions(cache, [Decision(layer, block, Op.EVICT) for layer in (0, 1) for block in blocks])
    view = CacheView.from_cache(cache, [4, 4], phase="decode", model=model, token_ids=torch.tensor(ids))
    assert (view.tier[:, list(blocks)] == Tier.HOST).all()
    return view


@torch.no_grad()
def test_a_draft_on_a_chosen_set_reads_offloaded_blocks_where_they_lie(tiny_model):
    """Offloaded blocks chosen back: the draft is the one the cache made before it offloaded them."""
    cache, view, ids, _ = decode_view(tiny_model, host_blocks=8)
    reference, first = lookahead.draft_queries(view, DRAFT)  # nothing offloaded yet
    view = offload(cache, tiny_model, ids)
    queries, chosen_first = lookahead.draft_queries(view, DRAFT, view.live_blocks)
    assert chosen_first == first
    for layer in range(2):
        assert torch.allclose(queries[layer], reference[layer], atol=1e-5), layer
    device_only, _ = lookahead.draft_queries(view, DRAFT)  # negative control: without the offloaded blocks
    assert not torch.allclose(device_only[1], reference[1], atol=1e-3)


@torch.no_grad()
def test_a_live_draft_reads_every_live_block_and_counts_the_bytes_it_reads(tiny_model):
    """``live``: the draft runs on every live block, the offloaded ones read where they lie (the draft the cache made
    before offloading them, tested above), and those reads are counted as host-side attention bytes."""
    cache, _, ids, _ = decode_view(tiny_model, host_blocks=8)
    view = offload(cache, tiny_model, ids)
    share = lookahead.lookahead_scores(view, DRAFT, live=True)
    queries, first = lookahead.draft_queries(view, DRAFT, view.live_blocks)
    assert torch.allclose(share, view.attention_share(queries, first).amax(dim=-1))
    assert not torch.allclose(share, lookahead.lookahead_scores(view, DRAFT), atol=1e-3)  # the device blocks' draft
    # two drafts so far read the two offloaded blocks of both layers (the device-only draft reads none)
    assert cache.bytes_moved[("host", "host-attention")] == 2 * 2 * 2 * cache.device_pool(0).bytes_per_block


@torch.no_grad()
def test_each_round_drafts_on_the_set_the_previous_round_chose(tiny_model, monkeypatch):
    cache, _, ids, _ = decode_view(tiny_model, host_blocks=8)
    view = offload(cache, tiny_model, ids)
    real, sets = lookahead.draft_queries, []
    monkeypatch.setattr(lookahead, "draft_queries", lambda view, tokens, chosen=None: sets.append(chosen) or real(
        view, tokens, chosen))
    share = lookahead.lookahead_scores(view, DRAFT, rounds=2)
    first = view.attention_share(*real(view, DRAFT)).amax(dim=-1)
    assert sets[0] is None and torch.equal(sets[1], torch.from_numpy(keep_top(view, first.numpy()).device))
    assert (sets[1] & (view.tier == Tier.HOST)).any()  # the second draft reads an offloaded block
    assert torch.allclose(share, view.attention_share(*real(view, DRAFT, sets[1])).amax(dim=-1))
    assert torch.allclose(lookahead.lookahead_scores(view, DRAFT), first)  # one round: the device blocks' draft


@torch.no_grad()
def test_the_ranker_drafts_only_at_the_answers_decision_points(tiny_model, monkeypatch):
    cache, view, ids, _ = decode_view(tiny_model, host_blocks=8)
    calls = []

    def scores(view, tokens, rounds, live=False):
        calls.append((view.phase, tokens, rounds) + (("live",) if live else ()))
        share = torch.zeros(view.num_layers, view.num_blocks)
        share[:, 2] = 1.0  # block 2 is what the draft reads
        return share

    monkeypatch.setattr("agents.ranker.controller.lookahead_scores", scores)
    controller = make_controller("ranker:policies/ranker_smollm2.pt,lookahead=4,lookahead_rounds=2,merge=false")
    plain = make_controller("ranker:policies/ranker_smollm2.pt,merge=false")
    controller.scores = plain.scores = lambda view: (np.arange(view.num_blocks, dtype=np.float64)[None].repeat(2, 0), None)
    decided = controller.decide(view)  # the policy alone keeps the newest blocks
    assert calls == [("decode", 4, 2)]
    assert decided.device[:, 2].all() and not plain.decide(view).device[:, 2].any()  # negative control: no draft
    for phase in ("prefill", "question"):
        other = CacheView.from_cache(cache, [4, 4], phase=phase, model=tiny_model, token_ids=torch.tensor(ids))
        assert np.array_equal(controller.decide(other).device, plain.decide(other).device)
    assert calls == [("decode", 4, 2)]
    assert (view.tier[:, 2] == Tier.DEVICE).all()  # the draft ran on a copy: the cache itself is unchanged
    asking = make_controller("ranker:policies/ranker_smollm2.pt,lookahead=4,lookahead_question=true,merge=false")
    asking.scores = plain.scores
    for phase in ("prefill", "question"):  # lookahead_question: the question's decision point drafts as well
        other = CacheView.from_cache(cache, [4, 4], phase=phase, model=tiny_model, token_ids=torch.tensor(ids))
        assert asking.decide(other).device[:, 2].all() == (phase == "question")
    assert calls == [("decode", 4, 2), ("question", 4, 1)]
    live = make_controller("ranker:policies/ranker_smollm2.pt,lookahead=4,lookahead_question=true,"
                           "question_draft_live=true,merge=false")
    live.scores = plain.scores
    for phase in ("question", "decode"):  # only the question's draft reads every live block
        live.decide(CacheView.from_cache(cache, [4, 4], phase=phase, model=tiny_model, token_ids=torch.tensor(ids)))
    assert calls[-2:] == [("question", 4, 1, "live"), ("decode", 4, 1)]
    with pytest.raises(ValueError, match="lookahead_question=true"):
        make_controller("ranker:policies/ranker_smollm2.pt,lookahead=4,question_draft_live=true")
    for bad in ("lookahead=-1", "lookahead=1.5", "lookahead=65", "lookahead_rounds=0", "lookahead_rounds=5"):
        with pytest.raises(ValueError, match="lookahead"):
            make_controller(f"ranker:policies/ranker_smollm2.pt,{bad}")


@torch.no_grad()
def test_lookahead_baseline_is_its_base_but_at_the_answers_decision_points(tiny_model, monkeypatch):
    cache, view, ids, _ = decode_view(tiny_model, host_blocks=8)
    drafts = []

    def scores(view, tokens, rounds, live=False):
        drafts.append((view.phase, live))
        return torch.eye(view.num_blocks)[2].repeat(2, 1)

    monkeypatch.setattr(lookahead, "lookahead_scores", scores)
    wrapped, base = make_controller("lookahead:tova,tokens=4"), make_controller("tova")
    assert wrapped.decide(view).device[:, 2].all()
    # negative control: TOVA alone sends block 2 away
    assert {d.op for d in base.decide(view) if d.block == 2} <= {Op.EVICT, Op.MERGE} and any(
        d.block == 2 for d in base.decide(view))
    question = CacheView.from_cache(cache, [4, 4], phase="question", model=tiny_model, token_ids=torch.tensor(ids))
    assert sorted(wrapped.decide(question)) == sorted(base.decide(question))
    assert drafts == [("decode", False)]
    live = make_controller("lookahead:tova,tokens=4,question_draft_live=true")  # the question's decision drafts too
    assert live.decide(question).device[:, 2].all() and drafts[-1] == ("question", True)
    for spec in ("lookahead:oracle", "lookahead:bogus", "lookahead:tova,tokens=0", "lookahead:tova,stay=-1",
                 "lookahead:tova,rounds=0"):
        with pytest.raises(ValueError, match="lookahead"):
            make_controller(spec)


@pytest.mark.parametrize("base", [name for name in BASELINES if name not in lookahead.NOT_A_BASE])
def test_every_baseline_runs_behind_the_draft_within_its_budget(tiny_model, base):
    """A streamed run with a host tier: the base's decisions, then the draft's at the answer; no fallback, the
    budget held on every layer (under the base's global budget, KVzip's, in total)."""
    controller = make_controller(f"lookahead:{base},tokens=3")
    runner = Runner(tiny_model, controller=controller, budget=5, prefill_chunk=32, decide_every=3,
                    cache_config=CacheConfig(host_blocks=64))
    result = runner.run(torch.randint(2, 256, (1, 200), generator=torch.Generator().manual_seed(0)), max_new_tokens=12,
                        stop_at_eos=False)
    assert result.fallbacks == 0 and len(result.new_tokens) == 12
    device = result.blocks_per_tier["device"]
    if getattr(controller, "budget_scope", "layer") == "global":  # KVzip's: only the total holds (kvpress)
        assert sum(device) <= sum(result.budget_blocks) <= 10
    else:
        assert all(d <= b for d, b in zip(device, result.budget_blocks, strict=True))
