"""The ranking action (every block scored, top-b kept per layer), its exact regret reward, the recorded decision
points and their replay env, the ranking policy's file, training and controller."""

import itertools
import math

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from agents.policy_file import sha256_hex
from agents.ranker.controller import RankerController
from agents.ranker.model import BlockScorer, PolicyFileError, _weights_bytes, load_ranker, save_ranker
from agents.ranker.train import dropped_columns, listwise_loss, plackett_luce_topk, regret_table, train
from agents.registry import make_controller
from cache.controller import CacheView, Decision, Op, page_bounds
from cache.paged_cache import CacheConfig
from cache.ranking import RANK_FEATURES, block_features, keep_top, stable_argsort, within_layer_rank
from cache.runner import Prompt, Runner
from cache.tiers import Tier
from kvgym.envs.decisions import (
    BUDGETS,
    Decisions,
    RankingReplayEnv,
    block_value_norms,
    decision_point,
    kept_share,
    load_records,
    streaming_state,
    target_heads,
)
from kvgym.envs.reward import kept_by_ranking, ranking_regret
from tests.test_baselines_common import Checked

PROMPT = torch.randint(2, 256, (1, 200), generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------------------ the reward
def brute_force_regret(scores, mass, room, candidates):
    index = [i for i in range(len(mass)) if candidates[i]]
    total = sum(mass[i] for i in index)
    kept = sorted(index, key=lambda i: -scores[i])[:room]
    best = max(sum(mass[i] for i in subset) for subset in itertools.combinations(index, min(room, len(index))))
    return (best - sum(mass[i] for i in kept)) / total


def test_ranking_regret_matches_brute_force_and_rejects_a_wrong_ranking():
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        n = 8
        mass = torch.rand(n, generator=generator) ** 3
        scores = torch.randn(n, generator=generator)
        candidates = torch.rand(n, generator=generator) > 0.2
        room = int(torch.randint(0, n, (1,), generator=generator))
        got = float(ranking_regret(scores[None], mass[None], torch.tensor([room]), candidates[None])[0])
        want = brute_force_regret(scores.tolist(), mass.tolist(), room, candidates.tolist())
        assert got == pytest.approx(want, abs=1e-6)
        assert 0.0 <= got <= 1.0
    mass = torch.tensor([[0.0, 5.0, 1.0, 3.0, 0.5]])
    everyone = torch.ones_like(mass, dtype=torch.bool)
    assert float(ranking_regret(mass, mass, torch.tensor([2]), everyone)) == 0.0  # the oracle's own ranking
    wrong = float(ranking_regret(-mass, mass, torch.tensor([2]), everyone))  # negative control: the reverse
    assert wrong == pytest.approx((8.0 - 0.5) / 9.5)


def test_stable_argsort_is_numpys_stable_order_ties_and_specials_included():
    rng = np.random.default_rng(3)
    values = rng.standard_normal((6, 4, 40)).astype(np.float32).round(1)  # ties happen
    values[..., ::5] = 0.0
    values[..., 1::7] = -0.0  # ties +0.0, as the float comparison says
    values[..., 2::9] = -np.inf
    values[..., 3::11] = np.inf
    values[0, 0, [4, 9, 17]] = np.nan  # NaN last, in index order
    values[1, 1, 6] = -np.nan
    want = np.argsort(values, axis=-1, kind="stable")
    assert np.array_equal(stable_argsort(values), want)
    assert np.array_equal(stable_argsort(values.astype(np.float64)), want)  # the other dtypes' path
    # negative control: numpy's unstable sort orders these ties otherwise
    assert not np.array_equal(np.argsort(values, axis=-1, kind="quicksort"), want)


def test_kept_by_ranking_keeps_exactly_the_top_room_candidates():
    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(50, 10, generator=generator).round(decimals=1)  # ties happen
    candidates = torch.rand(50, 10, generator=generator) > 0.3
    room = torch.randint(0, 10, (50,), generator=generator)
    kept = kept_by_ranking(scores, room, candidates)
    for row in range(50):
        index = [i for i in range(10) if candidates[row, i]]
        want = sorted(index, key=lambda i: -float(scores[row, i]))[: int(room[row])]  # stable: ties in block order
        assert torch.nonzero(kept[row]).flatten().tolist() == sorted(want)
    assert not (kept & ~candidates).any() and (kept.sum(-1) == torch.minimum(room, candidates.sum(-1))).all()
    mass = torch.rand(50, 10, generator=generator)  # the regret is the mass the kept set misses against the oracle
    missed = torch.where(candidates & ~kept, mass, 0.0).sum(-1) - torch.where(
        candidates & ~kept_by_ranking(mass, room, candidates), mass, 0.0).sum(-1)
    total = torch.where(candidates, mass, 0.0).sum(-1)
    assert torch.allclose(ranking_regret(scores, mass, room, candidates), (missed / total.clamp(min=1e-12)).clamp(min=0))
    assert not torch.equal(kept_by_ranking(-scores, room, candidates), kept)  # negative control: the reverse ranking


# ------------------------------------------------------------------------------------------ the action
def view_after_prefill(model, host_blocks=32):
    runner = Runner(model, cache_config=CacheConfig(host_blocks=host_blocks), protocol="oneshot-question")
    cache = runner.dense_prefill(Prompt(PROMPT), 8).cache.clone(host_blocks=host_blocks)  # a shared prefill has no host
    return cache, CacheView.from_cache(cache, [5, 5], phase="compress")


def test_block_features_are_finite_and_describe_every_block(tiny_model):
    _, view = view_after_prefill(tiny_model)
    features = block_features(view)
    assert features.shape == (2, view.num_blocks, len(RANK_FEATURES))
    assert np.isfinite(features).all()
    column = {name: i for i, name in enumerate(RANK_FEATURES)}
    for name in RANK_FEATURES:
        if name.endswith("_rank"):
            assert features[..., column[name]].min() >= 0 and features[..., column[name]].max() <= 1
    assert (features[..., column["phase_compress"]] == 1).all()
    assert (features[..., column["tier_device"]] == 1).all()
    # the TOVA column ranks blocks exactly as the last query's attention does
    last_query = view.mass("last_query", "mean")
    order = np.argsort(-features[0, :, column["last_query_mean_rank"]], kind="stable")
    assert last_query[0, order[0]] == last_query[0].max()


def test_page_bound_features_score_offloaded_blocks_by_quests_bound(tiny_model):
    from cache.controller import apply_decisions

    cache, view = view_after_prefill(tiny_model)
    apply_decisions(cache, [Decision(layer, block, Op.EVICT) for layer in range(2) for block in (2, 3, 4)])
    view = CacheView.from_cache(cache, [5, 5], phase="question")
    features = block_features(view)
    column = {name: i for i, name in enumerate(RANK_FEATURES)}
    assert (features[:, 2:5, column["tier_host"]] == 1).all()
    # Quest's bound from the raw keys of each block (the pool's keys: offloaded blocks keep theirs on the host)
    bound = page_bounds(view.last_query, view.key_min, view.key_max).amax(dim=-1)
    valid = np.ones(bound.shape, bool)
    assert np.allclose(features[..., column["page_bound_max_rank"]], within_layer_rank(bound.numpy(), valid))
    shares = np.exp(features[..., column["page_bound_max_log_share"]]) - 1e-4  # N x softmax share
    assert np.allclose(shares.sum(axis=1), view.num_blocks, rtol=1e-3)
    # negative control: the attention-mass columns know nothing new of blocks the latest queries could not see
    assert not np.allclose(features[..., column["page_bound_max_rank"]], features[..., column["last_max_rank"]])


def test_streaming_states_show_the_policy_what_streaming_leaves_it(tiny_model):
    prompt = Prompt(PROMPT, context_end=160)
    record = decision_point(tiny_model, prompt, max_new_tokens=4, block_size=16)
    state = streaming_state(tiny_model, prompt, make_controller("quest"), budget=5, host_blocks=64, block_size=16)
    assert state["phase"] == "question" and state["features"].shape == record["features"].shape
    features = state["features"].float()
    column = {name: i for i, name in enumerate(RANK_FEATURES)}
    assert (features[..., column["phase_question"]] == 1).all()
    assert (features[..., column["tier_host"]] == 1).any()  # the prefill offloaded blocks: the policy can fetch them
    assert [s["phase"] for s in state["other_states"]] == ["prefill", "prefill", "decode"]
    # half and 3/4 of the 13 blocks read, then the decode decision after the last prompt token (200 tokens: 13)
    assert [s["features"].shape[1] for s in state["other_states"]] == [8, 10, 13]
    assert state["budgets"] == [5]


def test_load_records_expands_streaming_states_with_their_own_future(tmp_path):
    record = synthetic_records(1, seed=3)[0]
    streaming = {**record, "budgets": [0.25], "protocol": "streaming",
                 "other_states": [{"features": record["features"][:, :10], "device_blocks": torch.tensor([8, 8]),
                                   "phase": "prefill"},
                                  {"features": torch.cat([record["features"], record["features"][:, -1:]], dim=1),
                                   "device_blocks": torch.tensor([8, 8]), "phase": "decode"}]}
    torch.save(record, tmp_path / "a.pt")
    torch.save(streaming, tmp_path / "a_streaming.pt")
    records = load_records([tmp_path / "a.pt", tmp_path / "a_streaming.pt"])
    assert len(records) == 4 and "other_states" not in records[1]
    assert torch.equal(records[2]["future_heads"], record["future_heads"][..., :10])  # cut to the blocks read
    assert torch.equal(records[3]["future_heads"][..., :24], record["future_heads"])  # a block begun since: 0
    assert (records[3]["future_heads"][..., 24] == 0).all()
    decisions = Decisions(records)
    assert len(decisions) == 2 * (len(BUDGETS) + 3)  # 2 layers: every budget, then each streaming state's own
    assert (decisions.budget[2 * len(BUDGETS):] == 0.25).all()
    kept = decisions.kept(torch.randn(decisions.candidates.shape, generator=torch.Generator().manual_seed(0)))
    assert not (kept & ~decisions.candidates).any()
    assert torch.equal(kept.sum(-1), torch.minimum(decisions.room, decisions.candidates.sum(-1)))


def test_top_b_numpy_and_torch_paths_keep_the_same_blocks_as_a_plain_sort():
    """Reference: Python's sort per row (score descending, then block order); many ties, negative rooms. The
    numpy path (keep_top, the replay twin) and the torch path (training) must give the same answer; negative
    control: a reversed tie order differs."""
    from cache.ranking import top_b

    rng = np.random.default_rng(5)
    for shape in ((3, 12), (2, 4, 9)):
        scores = rng.integers(0, 4, shape).astype(np.float32)
        candidates = rng.random(shape) > 0.3
        room = rng.integers(-1, shape[-1], shape[:-1])
        got = top_b(scores, candidates, room)
        assert isinstance(got, np.ndarray)
        assert np.array_equal(got, top_b(torch.from_numpy(scores), torch.from_numpy(candidates),
                                         torch.from_numpy(room)).numpy())
        want = np.zeros(shape, bool)
        wrong = np.zeros(shape, bool)
        for row in np.ndindex(shape[:-1]):
            index = [b for b in range(shape[-1]) if candidates[row][b]]
            best = sorted(index, key=lambda b: (-scores[row][b], b))[: max(int(room[row]), 0)]
            worst_ties = sorted(index, key=lambda b: (-scores[row][b], -b))[: max(int(room[row]), 0)]
            want[row][best] = True
            wrong[row][worst_ties] = True
        assert np.array_equal(got, want)
        assert not np.array_equal(got, wrong)


def test_keep_top_keeps_the_best_scores_and_the_pinned_blocks(tiny_model):
    cache, view = view_after_prefill(tiny_model)
    n = view.num_blocks
    scores = torch.arange(n, dtype=torch.float32).flip(0).expand(2, n)  # prefers the oldest blocks
    decisions = keep_top(view, scores)
    assert all(d.op == Op.EVICT for d in decisions)
    for layer in range(2):
        evicted = sorted(d.block for d in decisions if d.layer == layer)
        # 5 blocks: sink 0 and newest n-1 pinned, then the best three others (1, 2, 3)
        assert evicted == list(range(4, n - 1))
    merged = keep_top(view, scores, merge=torch.ones(2, n))
    assert {d.op for d in merged} == {Op.MERGE}
    with pytest.raises(ValueError, match="ranking scores"):
        keep_top(view, scores[:, :-1])


def test_keep_top_prefetches_offloaded_blocks_that_rise(tiny_model):
    from cache.controller import apply_decisions

    cache, view = view_after_prefill(tiny_model)
    n = view.num_blocks
    oldest_first = torch.arange(n, dtype=torch.float32).flip(0).expand(2, n)
    apply_decisions(cache, keep_top(view, oldest_first))
    view = CacheView.from_cache(cache, [5, 5], phase="compress")
    decisions = keep_top(view, -oldest_first)  # now the newest: blocks 1-3 go, n-4..n-2 come back from the host
    for layer in range(2):
        assert sorted(d.block for d in decisions if d.layer == layer and d.op == Op.PREFETCH) == [n - 4, n - 3, n - 2]
        assert sorted(d.block for d in decisions if d.layer == layer and d.op == Op.EVICT) == [1, 2, 3]
    apply_decisions(cache, decisions)
    after = CacheView.from_cache(cache, [5, 5], phase="compress")
    assert ((after.tier == 0).sum(dim=1) == 5).all()


def test_keep_top_stay_margin_keeps_residents_against_a_near_tie_only(tiny_model):
    """With ``stay`` the resident blocks rank ``stay`` score std devs higher: an offloaded block that beats the
    weakest resident by less than that stays on the host (no operation at all), one that beats it by more still
    comes back (one eviction for the prefetch). Negative control: without the margin the near tie swaps."""
    from cache.controller import apply_decisions

    cache, view = view_after_prefill(tiny_model)
    n = view.num_blocks
    oldest_first = torch.arange(n, dtype=torch.float32).flip(0).expand(2, n).clone()
    apply_decisions(cache, keep_top(view, oldest_first))  # blocks 1-3 stay on device, 4..n-2 go to the host
    view = CacheView.from_cache(cache, [5, 5], phase="compress")
    near = oldest_first.clone()
    near[:, n - 2] = near[:, 3] + 0.5  # offloaded block n-2 now just beats resident block 3
    swaps = keep_top(view, near)
    assert sorted((d.block, d.op) for d in swaps if d.layer == 0) == [(3, Op.EVICT), (n - 2, Op.PREFETCH)]
    assert list(keep_top(view, near, stay=0.5)) == []  # std of the candidates' scores ~ n / 3.5: margin > 0.5
    far = oldest_first.clone()
    far[:, n - 2] = 1e6
    assert sorted((d.block, d.op) for d in keep_top(view, far, stay=0.5) if d.layer == 1) == [(3, Op.EVICT),
                                                                                              (n - 2, Op.PREFETCH)]
    with pytest.raises(ValueError, match="stay"):
        keep_top(view, near, stay=-1.0)
    controller = make_controller("ranker:policies/ranker_smollm2.pt,stay=0.5")
    assert isinstance(controller, RankerController) and controller.stay == 0.5
    # question_stay: the margin at the question's decision point only (the near tie swaps there, nowhere else)
    controller = make_controller("ranker:policies/ranker_smollm2.pt,stay=0.5,question_stay=0,merge=false")
    controller.scores = lambda view: (near.numpy(), None)
    for phase, swapped in (("question", True), ("decode", False), ("prefill", False)):
        view = CacheView.from_cache(cache, [5, 5], phase=phase)
        assert (list(controller.decide(view)) == list(swaps)) is swapped, phase
    with pytest.raises(ValueError, match="question_stay"):
        make_controller("ranker:policies/ranker_smollm2.pt,question_stay=-1")


def test_keep_top_leaves_exactly_the_pinned_and_top_scored_blocks_on_device(tiny_model):
    """Reference: a plain per-layer sort (score descending, then block order); ties, offloaded and dropped
    blocks, budgets that differ per layer."""
    from cache.controller import apply_decisions

    rng = np.random.default_rng(3)
    cache, view = view_after_prefill(tiny_model, host_blocks=8)
    n = view.num_blocks
    apply_decisions(cache, keep_top(view, torch.from_numpy(rng.normal(size=(2, n))).float()))  # some go to the host
    for budget in ([6, 4], [3, 9], [n, 2]):
        view = CacheView.from_cache(cache, budget, phase="compress")
        scores = rng.integers(0, 3, (2, n)).astype(np.float32)  # many ties
        decisions = keep_top(view, scores, merge=rng.normal(size=(2, n)))
        for layer in range(2):
            tier, pinned = view.tier[layer].tolist(), view.pinned[layer].tolist()
            live = [b for b in range(n) if tier[b] != Tier.DROPPED]
            pinned_live = [b for b in live if pinned[b]]
            others = sorted((b for b in live if not pinned[b]), key=lambda b: (-scores[layer, b], b))
            want = set(pinned_live) | set(others[: max(budget[layer] - len(pinned_live), 0)])
            on_device = {b for b in range(n) if tier[b] == Tier.DEVICE}
            ops = [d for d in decisions if d.layer == layer]
            assert {d.block for d in ops if d.op in (Op.EVICT, Op.MERGE)} == on_device - want
            assert {d.block for d in ops if d.op == Op.PREFETCH} == want - on_device
        apply_decisions(cache, decisions)  # the next budget starts from what these left


# ------------------------------------------------------------------------------------------ decision points
@pytest.mark.parametrize("protocol", ["oneshot-question", "oneshot"])
def test_future_attention_of_a_decision_point_matches_eager_attention(tiny_model, protocol):
    """Independent reference: transformers' eager attention over the whole sequence (no paged cache). In
    ``oneshot`` the decision comes after the context (150 tokens) alone: the question's queries are future too."""
    from cache.models import tiny_random_llama

    context_end = 150
    record = decision_point(tiny_model, Prompt(PROMPT[0].tolist(), context_end=context_end), max_new_tokens=6,
                            block_size=16, protocol=protocol)
    answer = record["answer"].tolist()
    reference = tiny_random_llama()
    reference.set_attn_implementation("eager")
    ids = torch.tensor([PROMPT[0].tolist() + answer])
    with torch.no_grad():
        attentions = reference(ids, output_attentions=True).attentions  # L x [1, H, T, T]
    prompt_len, n = PROMPT.shape[1], record["future_heads"].shape[-1]
    decided_at = prompt_len - 1 if protocol == "oneshot-question" else context_end
    assert n == math.ceil(decided_at / 16)
    rows = slice(decided_at, prompt_len - 1 + len(answer))  # what is fed after the decision, the answer included
    for layer, attention in enumerate(attentions):
        per_token = attention[0, :, rows, : n * 16].sum(dim=1)  # [H, tokens]
        per_block = torch.nn.functional.pad(per_token, (0, n * 16 - per_token.shape[1])).view(-1, n, 16).sum(-1)
        assert torch.allclose(record["future_heads"][layer], per_block, atol=1e-4)
    # negative control: the answer's attention alone (the old oneshot-question future) misses the question's
    if protocol == "oneshot":
        answer_only = attentions[0][0, :, prompt_len - 1:, : n * 16].sum(dim=1)
        answer_only = torch.nn.functional.pad(answer_only, (0, n * 16 - answer_only.shape[1])).view(-1, n, 16).sum(-1)
        assert not torch.allclose(record["future_heads"][0], answer_only, atol=1e-2)
    features = record["features"].float()
    assert features.shape == (2, n, len(RANK_FEATURES)) and torch.isfinite(features).all()
    # the features are the policy's: a question-blind compression shows the prefill phase
    shown = "phase_compress" if protocol == "oneshot-question" else "phase_prefill"
    assert (features[..., RANK_FEATURES.index(shown)] == 1).all()


def test_value_norms_of_a_decision_point_match_dynamic_cache_and_weight_the_future_value_target(tiny_model):
    """Independent reference: the values transformers' ``DynamicCache`` holds after the same prefill; the
    ``future_value`` target is the future attention times its KV group's value norm (negative control: the
    wrong group's norms differ)."""
    from transformers import DynamicCache

    from cache.models import tiny_random_llama

    record = decision_point(tiny_model, Prompt(PROMPT[0].tolist(), context_end=150), max_new_tokens=4, block_size=16)
    reference = tiny_random_llama()
    dynamic = DynamicCache()
    with torch.no_grad():
        reference(PROMPT[:, :-1], cache=dynamic, use_cache=True)  # oneshot-question: all but the last token
    n = record["future_heads"].shape[-1]
    for layer in range(2):
        values = dynamic.layers[layer].values[0]  # [kv_heads, T, head_dim]
        per_token = torch.nn.functional.pad(values.norm(dim=-1), (0, n * 16 - values.shape[1]))
        counts = torch.nn.functional.pad(torch.ones(values.shape[1]), (0, n * 16 - values.shape[1])).view(n, 16).sum(-1)
        expected = per_token.view(-1, n, 16).sum(-1) / counts
        assert torch.allclose(record["value_norms"][layer].float(), expected, rtol=2e-3, atol=1e-3)
    weighted = target_heads(record, "future_value")
    norms = record["value_norms"].float()
    group = record["future_heads"].shape[1] // norms.shape[1]
    assert group > 1
    assert torch.allclose(weighted[:, 0], record["future_heads"][:, 0] * norms[:, 0])
    assert torch.allclose(weighted[:, group], record["future_heads"][:, group] * norms[:, 1])
    assert not torch.allclose(weighted[:, group], record["future_heads"][:, group] * norms[:, 0])  # wrong group
    regret = Decisions([record], budgets=(0.25,), target="future_value")
    assert regret.mass.shape == (2, n) and torch.isfinite(regret.mass).all()
    with pytest.raises(ValueError, match="value_norms"):
        Decisions([{k: v for k, v in record.items() if k != "value_norms"}], target="future_value")


def test_teacher_kept_is_kvpress_selection_over_all_layers_per_kv_head(tiny_model):
    """``teacher_kept``: the (layer, KV head, block) entries compete for ``kv_heads × room.sum()`` places over all
    layers, checked against a brute-force sort; a layer whose scores are all high takes more than its own room
    (negative control: the same share in every layer would not); non-candidates are never kept."""
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(3, 6, 10, generator=generator)
    scores[0] += 1.0  # layer 0 outscores the others everywhere
    candidates = torch.rand(3, 10, generator=generator) > 0.2
    room = torch.tensor([2, 3, 1])
    share = kept_share(scores, 2, candidates, room)
    per_kv = scores.reshape(3, 2, 3, 10).amax(dim=2)
    entries = sorted(((float(per_kv[layer, h, n]), layer, n) for layer in range(3) for h in range(2)
                      for n in range(10) if candidates[layer, n]), reverse=True)[: 2 * int(room.sum())]
    expected = torch.zeros(3, 10)
    for _, layer, n in entries:
        expected[layer, n] += 0.5
    assert torch.equal(share, expected)
    assert float(share.sum()) * 2 == 2 * int(room.sum())
    assert float(share[0].sum()) > int(room[0])  # global: layer 0 keeps more than its own room
    assert float(share[~candidates].abs().sum()) == 0
    record = decision_point(tiny_model, Prompt(PROMPT[0].tolist(), context_end=150), max_new_tokens=4, block_size=16,
                            teacher=lambda view: torch.rand(view.acc_mass_heads.shape, generator=generator))
    rows = Decisions([record], budgets=(0.25,), target="teacher_kept")
    kv_heads = record["value_norms"].shape[1]
    assert torch.equal(rows.mass, kept_share(record["teacher_heads"], kv_heads, rows.candidates, rows.room))
    assert float(rows.mass.sum()) == float(rows.room.sum())
    assert set((rows.mass * kv_heads).round().unique().tolist()) <= set(range(kv_heads + 1))


def test_value_norms_ignore_the_unwritten_slots_of_a_partial_block(tiny_model):
    """The pools are ``torch.empty``: a partial block's unwritten slots hold whatever was in memory, NaN
    included. Poisoning them must not change any block's mean value norm (it did, intermittently: 0 × NaN)."""
    cache, view = view_after_prefill(tiny_model)
    clean = block_value_norms(view)
    for layer in range(view.num_layers):
        last = int(torch.nonzero(view.tier[layer] == Tier.DEVICE).max())
        filled = int(view.num_tokens[layer, last])
        assert 0 < filled < cache.block_size  # the prompt leaves a partial newest block
        pool = cache.device_pool(layer)
        pool.values[cache.tables.physical[layer, last], filled:] = float("nan")
    poisoned = block_value_norms(view)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


def test_a_teacher_scores_the_question_blind_decision_point_it_is_shown(tiny_model):
    """The teacher sees the decision's view (the model, the context's tokens, the question not read) and its
    scores are recorded beside the future attention; ``Decisions(target="teacher")`` scores rankings by them."""
    from agents.baselines.kvzip import reconstruction_mass

    seen = {}

    def teacher(view):
        seen.update(tokens=view.token_ids.tolist(), question_read=view.question_read, model=view.model)
        return reconstruction_mass(view, chunk_size=2048)

    prompt = Prompt(PROMPT[0].tolist(), context_end=150)
    record = decision_point(tiny_model, prompt, max_new_tokens=4, block_size=16, protocol="oneshot", teacher=teacher)
    assert seen == {"tokens": PROMPT[0, :150].tolist(), "question_read": False, "model": tiny_model}
    teacher_heads = record["teacher_heads"]
    assert teacher_heads.shape == record["future_heads"].shape == (2, 4, 10)
    assert not torch.allclose(teacher_heads, record["future_heads"])  # reconstruction is not the future
    # KVzip's controller evicts by the same scores: with a budget of 5 blocks per layer the blocks it keeps are the
    # top 3 of the teacher's (besides the sink and the newest block)
    kvzip = make_controller("kvzip:layerwise=true,per_head=false")
    compressions = []

    def decide(view):
        decisions = type(kvzip).decide(kvzip, view)
        if view.phase == "compress":
            compressions.append(decisions)
        return decisions

    kvzip.decide = decide
    Runner(tiny_model, None, CacheConfig(block_size=16), controller=kvzip, budget=5, protocol="oneshot").run(
        prompt, max_new_tokens=1)
    evicted_live = [{d.block for d in compressions[0] if d.layer == layer} for layer in range(2)]
    scores = teacher_heads.amax(dim=1)[:, 1:9]
    evicted_taught = [set((torch.topk(scores[layer], 5, largest=False).indices + 1).tolist()) for layer in range(2)]
    assert len(compressions) == 1 and evicted_live == evicted_taught
    decisions = Decisions([record], target="teacher")
    assert torch.equal(decisions.mass[: 2], teacher_heads.amax(dim=1))
    assert (decisions.regret(decisions.mass) == 0).all()
    assert (decisions.regret(-decisions.mass) > 0).any()  # negative control: the reverse of the teacher's order
    with pytest.raises(ValueError, match="teacher_heads"):
        Decisions([{k: v for k, v in record.items() if k != "teacher_heads"}], target="teacher")
    with pytest.raises(ValueError, match="shape"):
        decision_point(tiny_model, prompt, max_new_tokens=2, protocol="oneshot", teacher=lambda view: torch.zeros(3))


def test_training_on_a_teachers_scores_learns_the_teachers_ranking(tmp_path):
    """Records whose future attention follows one feature and whose teacher follows another: trained with
    ``target="teacher"`` the ranker follows the teacher (and, the control, with the default target the future)."""
    records, validation = synthetic_records(12, 1), synthetic_records(4, 2)
    teacher_column = RANK_FEATURES.index("key_norm_rank")
    for record in records + validation:
        features = record["features"].float()
        record["teacher_heads"] = features[..., teacher_column].exp()[:, None].expand(2, 3, -1).contiguous()
    runs = {target: train(records, validation, tmp_path / target, warm_epochs=15, rl_epochs=0, batch=16, seed=0,
                          target=target, log=lambda _: None) for target in ("teacher", "future")}
    teacher_view, future_view = Decisions(validation, target="teacher"), Decisions(validation)
    taught, _ = load_ranker(tmp_path / "teacher" / "ranker.pt")
    plain, _ = load_ranker(tmp_path / "future" / "ranker.pt")
    assert regret_table(teacher_view, taught)["ranker"]["all"] < 0.5 * regret_table(teacher_view, plain)["ranker"]["all"]
    assert regret_table(future_view, plain)["ranker"]["all"] < 0.5 * regret_table(future_view, taught)["ranker"]["all"]
    assert runs["teacher"]["target"] == "teacher"


def test_needle_weight_makes_the_blocks_that_state_the_answer_worth_that_much_more():
    record = {**synthetic_records(1, seed=5)[0], "answer_blocks": torch.tensor([3, 7, 40])}  # 40: past the end
    plain, weighted = Decisions([record], budgets=(0.25,)), Decisions([record], budgets=(0.25,), needle_weight=1.0)
    layer_mass = plain.mass / plain.mass.sum(dim=1, keepdim=True)
    expected = layer_mass.clone()
    expected[:, [3, 7]] += 0.5  # the weight shared by the needle's two blocks (block 40 is not in this record)
    assert torch.allclose(weighted.mass, expected)
    # keeping the needle is worth far more under the needle weight than under the attention alone (the control)
    scores = plain.mass.clone()
    scores[:, [3, 7]] = -1.0  # the attention oracle's order, the needle last
    keeping = scores.clone()
    keeping[:, [3, 7]] = 10.0
    gain_weighted = weighted.regret(scores) - weighted.regret(keeping)
    gain_plain = plain.regret(scores) - plain.regret(keeping)
    assert (gain_weighted > gain_plain + 0.3).all() and (gain_weighted > 0.3).all()
    with pytest.raises(ValueError, match="answer_blocks"):
        Decisions(synthetic_records(1, seed=5), needle_weight=1.0)
    with pytest.raises(ValueError, match="needle_weight"):
        Decisions([record], needle_weight=-1.0)


def synthetic_records(count: int, seed: int, signal: str = "last_mean_log_share"):
    """Decision points whose future mass is visible (with noise) in one feature column."""
    generator = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(count):
        n = 24
        features = torch.randn(2, n, len(RANK_FEATURES), generator=generator)
        features[..., RANK_FEATURES.index("valid")] = 1.0
        mass = torch.rand(2, 3, n, generator=generator) ** 6
        log_share = torch.log(mass.amax(dim=1) + 1e-4)
        features[..., RANK_FEATURES.index(signal)] = log_share + 0.3 * torch.randn(2, n, generator=generator)
        records.append({"features": features.half(), "future_heads": mass, "context_tokens": n * 16,
                        "device_blocks": torch.tensor([n, n]), "sink_blocks": 1, "block_size": 16})
    return records


def test_replay_env_passes_the_checker_and_pays_the_oracle_zero():
    decisions = Decisions(synthetic_records(3, 0))
    assert len(decisions) == 3 * len(BUDGETS) * 2
    env = RankingReplayEnv(decisions, max_blocks=32)
    check_env(env, skip_render_check=True)
    observation, info = env.reset(seed=0, options={"row": 4})
    oracle = np.zeros(32, np.float32)
    oracle[:24] = decisions.mass[4].numpy()
    _, reward, terminated, truncated, info = env.step(oracle)
    assert reward == 0.0 and terminated and not truncated
    env.reset(options={"row": 4})
    _, reward, *_ = env.step(-oracle)  # negative control: keeping the least-attended blocks costs
    assert reward < -0.1
    env.reset()
    with pytest.raises(ValueError, match="keep scores"):
        env.step(np.zeros(7, np.float32))
    env.step(oracle)  # a refused action leaves the episode open; this one ends it
    with pytest.raises(RuntimeError, match="reset"):
        env.step(oracle)


# ------------------------------------------------------------------------------------------ training
def test_plackett_luce_log_probability_matches_the_definition():
    scores = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    candidates = torch.tensor([[True, True, True, False]])
    keys, log_prob = plackett_luce_topk(scores, candidates, torch.tensor([2]), samples=5)
    for key, value in zip(keys[:, 0], log_prob[:, 0], strict=True):
        first, second = torch.argsort(key, descending=True)[:2].tolist()
        weights = scores[0, :3].exp()
        want = math.log(weights[first] / weights.sum()) + math.log(weights[second] / (weights.sum() - weights[first]))
        assert float(value) == pytest.approx(want, abs=1e-5)
        assert 3 not in (first, second)  # a pinned or padding block is never drawn


def test_training_learns_the_ranking_from_the_signal_feature(tmp_path):
    records, validation = synthetic_records(12, 1), synthetic_records(4, 2)
    summary = train(records, validation, tmp_path, warm_epochs=15, rl_epochs=5, batch=16, seed=0, log=lambda _: None)
    held = Decisions(validation)
    model, saved = load_ranker(tmp_path / "ranker.pt")
    learned = regret_table(held, model)["ranker"]["all"]
    untrained = regret_table(held, BlockScorer())["ranker"]["all"]
    assert learned < 0.5 * untrained  # an untrained scorer ranks at random
    assert learned == pytest.approx(saved["best"]["regret"], abs=1e-6)
    assert summary["best"]["regret"] == saved["best"]["regret"]
    assert (tmp_path / "warm_start.pt").is_file() and (tmp_path / "metrics.jsonl").read_text().count("\n") == 21
    assert any((tmp_path / "tensorboard").iterdir())
    scores = torch.randn(4, 24)
    # cross-entropy to the normalised future mass: lowest at the log of the mass itself
    assert float(listwise_loss(held.mass[:4].log(), held.mass[:4], held.candidates[:4])) < float(
        listwise_loss(scores, held.mass[:4], held.candidates[:4]))


def test_a_dropped_feature_is_never_read(tmp_path):
    """Trained with the signal's column dropped, the scorer's outputs do not move when that column does, and it
    cannot learn the ranking (negative control: the same training without the drop learns it; see above)."""
    records, validation = synthetic_records(12, 1), synthetic_records(4, 2)
    train(records, validation, tmp_path, warm_epochs=15, rl_epochs=5, batch=16, seed=0,
          drop_features=("last_mean_log_share", "keys"), log=lambda _: None)
    model, saved = load_ranker(tmp_path / "ranker.pt")
    assert saved["dropped_features"] == ["last_mean_log_share", "key_norm_rank", "key_distinct_rank"]
    features = Decisions(validation).features[:8]
    moved = features.clone()
    moved[..., dropped_columns(("last_mean_log_share", "keys"))] = torch.randn(8, features.shape[1], 3)
    for scorer in (lambda x: model(x)[0].detach().numpy(), lambda x: model.inference()(x.numpy())[0]):
        np.testing.assert_allclose(scorer(features), scorer(moved), rtol=0, atol=1e-5)
    kept = moved.clone()
    kept[..., RANK_FEATURES.index("last_max_log_share")] += 1.0  # a column it reads: the scores move
    assert not np.allclose(model(features)[0].detach().numpy(), model(kept)[0].detach().numpy())
    untrained = regret_table(Decisions(validation), BlockScorer())["ranker"]["all"]
    assert saved["best"]["regret"] > 0.5 * untrained
    with pytest.raises(ValueError, match="neither a feature"):
        dropped_columns(("positon",))


def test_training_refuses_to_write_an_untrained_file(tmp_path):
    records = synthetic_records(2, 1)
    for warm, rl in ((0, 0), (-1, -1), (-1, 5)):
        with pytest.raises(ValueError, match="an untrained file is not a policy"):
            train(records, records, tmp_path, warm_epochs=warm, rl_epochs=rl, log=lambda _: None)
    assert not (tmp_path / "ranker.pt").exists()


# ------------------------------------------------------------------------------------------ file and controller
def test_numpy_scorer_computes_the_torch_networks_function():
    """The controller decides with ``NumpyScorer`` (normalisation folded into the first layer, both heads in one
    matrix): it must give the module's own outputs; negative control: another network's scorer does not."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3, 40, len(RANK_FEATURES), generator=generator) * 5 + 2
    model, other = BlockScorer(hidden=16), BlockScorer(hidden=16)
    model.set_normalisation(features)
    other.set_normalisation(features)
    with torch.no_grad():
        keep, merge = model(features)
    fast_keep, fast_merge = model.inference()(features.numpy())
    assert fast_keep.shape == (3, 40) and fast_merge.shape == (3, 40)
    assert np.allclose(fast_keep, keep.numpy(), atol=1e-5) and np.allclose(fast_merge, merge.numpy(), atol=1e-5)
    assert not np.allclose(other.inference()(features.numpy())[0], keep.numpy(), atol=1e-3)


def test_ranker_file_round_trips_and_refuses_damage(tmp_path):
    model = BlockScorer(hidden=8)
    path = save_ranker(model, tmp_path / "r.pt", {"note": "test"})
    loaded, summary = load_ranker(path)
    x = torch.randn(3, 5, len(RANK_FEATURES))
    assert torch.equal(loaded(x)[0], model(x)[0]) and summary == {"note": "test"}
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:500])
    with pytest.raises(PolicyFileError, match="corrupt"):
        load_ranker(truncated)
    payload = torch.load(path, weights_only=True)
    payload["state_dict"]["score.bias"] += 1.0  # tampered weights, old checksum
    torch.save(payload, tmp_path / "tampered.pt")
    with pytest.raises(PolicyFileError, match="sha256"):
        load_ranker(tmp_path / "tampered.pt")
    payload = torch.load(path, weights_only=True)
    payload["features"] = payload["features"][:-1] + ["a_feature_kvgym_never_computed"]
    torch.save(payload, tmp_path / "other.pt")
    with pytest.raises(PolicyFileError, match="does not compute"):
        load_ranker(tmp_path / "other.pt")
    payload = torch.load(path, weights_only=True)
    payload["features"] = payload["features"][:-1]  # the names shrink, the weights do not: they cannot fit
    torch.save(payload, tmp_path / "misfit.pt")
    with pytest.raises(PolicyFileError, match="do not fit"):
        load_ranker(tmp_path / "misfit.pt")
    with pytest.raises(PolicyFileError, match="does not exist"):
        load_ranker(tmp_path / "missing.pt")


def test_a_file_trained_before_features_were_added_scores_as_it_was_trained(tmp_path):
    """A file naming a subset of ``RANK_FEATURES`` (in another order) loads over all of them and gives the scores
    its own network gives on its own columns; the features it never saw change nothing. Negative control: the
    same weights read as if their columns were in ``RANK_FEATURES``' order give other scores."""
    names = [name for name in RANK_FEATURES if not name.startswith("window_bound_")][::-1]
    old = BlockScorer(num_features=len(names), hidden=8)
    old.set_normalisation(torch.randn(50, len(names)) * 3 + 1)
    state = {name: tensor.clone() for name, tensor in old.state_dict().items()}
    payload = {"format": "kvgym-ranker", "version": 1, "features": names, "hidden": 8, "state_dict": state,
               "weights_sha256": sha256_hex(_weights_bytes(state)), "summary": "{}"}
    torch.save(payload, tmp_path / "old.pt")
    lifted, _ = load_ranker(tmp_path / "old.pt")
    x = torch.randn(2, 7, len(RANK_FEATURES))
    own = x[..., [RANK_FEATURES.index(name) for name in names]]
    with torch.no_grad():
        assert torch.allclose(lifted(x)[0], old(own)[0], atol=1e-5)
        assert torch.allclose(lifted(x)[1], old(own)[1], atol=1e-5)
        x[..., [RANK_FEATURES.index(n) for n in RANK_FEATURES if n.startswith("window_bound_")]] += 100.0
        assert torch.allclose(lifted(x)[0], old(x[..., [RANK_FEATURES.index(n) for n in names]])[0], atol=1e-5)
        assert not torch.allclose(old(x[..., : len(names)])[0], old(own)[0], atol=1e-3)


@pytest.mark.parametrize("protocol", ["streaming", "oneshot-question"])
def test_ranker_controller_decides_everything_itself(tiny_model, tmp_path, protocol):
    path = save_ranker(BlockScorer(hidden=8), tmp_path / "r.pt")
    controller = make_controller(f"ranker:{path}")
    assert isinstance(controller, RankerController)
    checked = Checked(controller)
    runner = Runner(tiny_model, controller=checked, budget=5, prefill_chunk=32, decide_every=3,
                    cache_config=CacheConfig(host_blocks=64), protocol=protocol, decode_budget="fixed")
    result = runner.run(PROMPT, max_new_tokens=24, stop_at_eos=False)
    assert checked.calls > 0 and result.fallbacks == 0
    assert all(device <= 5 for device in result.blocks_per_tier["device"])


def test_ranker_with_a_pyramid_keeps_each_layer_within_its_share(tiny_model, tmp_path):
    """``pyramid_beta`` > 1: the run's layer budgets are PyramidKV's pyramid of the same total, and every decision
    keeps each layer within its own share; the default split is even (negative control); beta < 1 is refused."""
    from agents.baselines.base import pyramid_split

    path = save_ranker(BlockScorer(hidden=8), tmp_path / "r.pt")
    results = {}
    for beta in (1.0, 20.0):
        checked = Checked(RankerController(str(path), pyramid_beta=beta))
        runner = Runner(tiny_model, controller=checked, budget=5, prefill_chunk=32, decide_every=3,
                        cache_config=CacheConfig(host_blocks=64), protocol="streaming", decode_budget="fixed")
        results[beta] = runner.run(PROMPT, max_new_tokens=24, stop_at_eos=False)
        assert checked.calls > 0 and results[beta].fallbacks == 0
        assert all(device <= budget for device, budget in zip(results[beta].blocks_per_tier["device"],
                                                              results[beta].budget_blocks, strict=True))
    assert results[1.0].budget_blocks == [5, 5]
    assert results[20.0].budget_blocks == pyramid_split([5, 5], 20.0) == [8, 2]
    for beta in (0.5, float("nan"), 1e4):
        with pytest.raises(ValueError, match="pyramid_beta"):
            RankerController(str(path), pyramid_beta=beta)


def test_ranker_shows_a_question_blind_compression_as_its_blind_phase(tiny_model, tmp_path):
    path = save_ranker(BlockScorer(hidden=8), tmp_path / "r.pt")
    cache, _ = view_after_prefill(tiny_model)
    blind = CacheView.from_cache(cache, [5, 5], phase="compress", question_read=False)
    read = CacheView.from_cache(cache, [5, 5], phase="compress", question_read=True)
    as_prefill = RankerController(str(path), blind_phase="prefill")
    features = block_features(blind)
    phase = [RANK_FEATURES.index(f"phase_{name}") for name in ("prefill", "compress")]
    assert (features[..., phase] == [0, 1]).all()
    features[..., phase] = [1, 0]
    assert np.array_equal(as_prefill.scores(blind)[0], as_prefill._model(features)[0])
    # the question read, or blind_phase=compress: the features as recorded (negative control: they differ)
    assert np.array_equal(as_prefill.scores(read)[0], as_prefill._model(block_features(read))[0])
    as_recorded = RankerController(str(path), blind_phase="compress")
    assert np.array_equal(as_recorded.scores(blind)[0], as_prefill._model(block_features(blind))[0])
    assert RankerController(str(path)).blind_phase == "prefill"
    assert not np.array_equal(as_prefill.scores(blind)[0], as_prefill.scores(read)[0])
    with pytest.raises(ValueError, match="blind_phase"):
        RankerController(str(path), blind_phase="context")


def test_a_blind_ranker_makes_only_the_question_blind_compressions(tiny_model, tmp_path):
    torch.manual_seed(0)
    main, blind_file = save_ranker(BlockScorer(hidden=8), tmp_path / "main.pt"), save_ranker(BlockScorer(hidden=8), tmp_path / "b.pt")
    cache, _ = view_after_prefill(tiny_model)
    views = {(phase, read): CacheView.from_cache(cache, [5, 5], phase=phase, question_read=read)
             for phase in ("compress", "prefill", "question") for read in (False, True)}
    both = RankerController(str(main), blind=str(blind_file))
    alone, blind_alone = RankerController(str(main)), RankerController(str(blind_file))
    for (phase, read), view in views.items():
        expected = blind_alone if (phase, read) == ("compress", False) else alone
        assert np.array_equal(both.scores(view)[0], expected.scores(view)[0]), (phase, read)
    # negative control: the two files score differently, so the check above can tell them apart
    assert not np.array_equal(alone.scores(views["compress", False])[0], blind_alone.scores(views["compress", False])[0])
    with pytest.raises(PolicyFileError, match="does not exist"):
        RankerController(str(main), blind=str(tmp_path / "missing.pt"))
    # blind_prefill: the blind file also makes a streamed prefill's question-blind decisions, and nothing else
    streaming = RankerController(str(main), blind=str(blind_file), blind_prefill=True)
    for (phase, read), view in views.items():
        expected = blind_alone if phase in ("compress", "prefill") and not read else alone
        assert np.array_equal(streaming.scores(view)[0], expected.scores(view)[0]), (phase, read)
    with pytest.raises(ValueError, match="blind_prefill"):
        RankerController(str(main), blind_prefill=True)


def test_bench_ranker_times_every_part_of_a_decision(tiny_model, tmp_path):
    from agents.ranker.benchmark import bench_decision, bench_replay

    report = bench_decision(tiny_model, "policies/ranker_smollm2.pt", context=256, repeats=2)
    assert report["layers"] == 2 and report["blocks_per_layer"] == 256 // 16
    for part in ("view_ms", "view_summaries_ms", "block_features_ms", "scorer_forward_ms", "keep_top_ms", "decide_ms",
                 "decision_ms", "decode_decision_ms", "budgeted_decode_decision_ms", "lookahead_decision_ms"):
        assert report[part]["median_ms"] > 0
    assert report["window_queries"] == 64  # the prefill's stats_window
    assert report["lookahead_tokens"] == 8
    with pytest.raises(ValueError, match="no decision points"):
        bench_replay(tmp_path)


def test_a_prefetch_decided_at_the_question_is_read_by_the_first_answer_token(tiny_model):
    """A block offloaded during the prefill and ranked first at the question decision is back on device when the
    last prompt token computes the first answer token: its attention reaches that block (negative control: the
    same run without the prefetch gives it none)."""
    prompt = Prompt(PROMPT, context_end=160)

    class Ranking:
        def __init__(self, prefetch: bool):
            self.prefetch, self.first_decode = prefetch, None

        def decide(self, view):
            if view.phase == "decode" and self.first_decode is None:
                self.first_decode = (view.tier.clone(), view.mass("last_query", "max").clone())
            scores = -torch.arange(view.num_blocks, dtype=torch.float32).expand(view.num_layers, -1).clone()
            if view.num_blocks > 2:
                scores[:, 2] = -1e9  # block 2: the worst while reading
                if view.phase == "question" and self.prefetch:
                    scores[:, 2] = 1e9  # ... and the best once the question is read
            return keep_top(view, scores)

    seen = {}
    for prefetch in (True, False):
        controller = Ranking(prefetch)
        result = Runner(tiny_model, controller=controller, budget=5, prefill_chunk=32,
                        cache_config=CacheConfig(host_blocks=64), protocol="streaming").run(prompt, max_new_tokens=2)
        assert result.fallbacks == 0
        seen[prefetch] = (controller.first_decode, result.operations.get("prefetch", 0))
    (tier, mass), prefetches = seen[True]
    assert prefetches > 0 and (tier[:, 2] == Tier.DEVICE).all() and (mass[:, 2] > 0).all()
    (tier, mass), prefetches = seen[False]
    assert prefetches == 0 and (tier[:, 2] == Tier.HOST).all() and (mass[:, 2] == 0).all()


def test_collect_records_blind_decisions_with_a_teacher_and_the_needle_and_resumes(smollm2, tmp_path):
    from eval.tasks import generate
    from eval.tasks.prompt import answer_positions
    from kvgym.envs.decisions import collect

    calls = []

    def teacher(view):
        calls.append(view.num_blocks)
        return view.acc_mass_heads.clone()

    args = (smollm2.model, smollm2.tokenizer, ["passkey"], [1024], 1, 5, tmp_path)
    paths = collect(*args, blind=True, blind_only=True, teacher=("acc", teacher), max_new_tokens=4, log=lambda _: None)
    assert [p.name for p in paths] == ["passkey_1024_s5_0_blind_acc.pt"] and sorted(tmp_path.iterdir()) == paths
    record = torch.load(paths[0], weights_only=True)
    assert record["protocol"] == "oneshot" and record["teacher_heads"].shape == record["future_heads"].shape
    sample = generate("passkey", smollm2.tokenizer, 1024, seed=5, index=0)
    needle = sorted({p // 16 for p in answer_positions(smollm2.tokenizer, sample)})
    assert record["answer_blocks"].tolist() == needle and needle
    # a file of an older kvgym (no answer_blocks) gets them on the next run, without recomputing anything
    torch.save({k: v for k, v in record.items() if k != "answer_blocks"}, paths[0])
    collect(*args, blind=True, blind_only=True, teacher=("acc", teacher), max_new_tokens=4, log=lambda _: None)
    again = torch.load(paths[0], weights_only=True)
    assert len(calls) == 1 and again["answer_blocks"].tolist() == needle
    assert torch.equal(again["teacher_heads"], record["teacher_heads"])
    with pytest.raises(ValueError, match="blind"):
        collect(*args, blind_only=True)


def test_the_shipped_blind_rankers_load_and_say_what_they_were_trained_on():
    from pathlib import Path

    policies = Path(__file__).resolve().parents[1] / "policies"
    shipped = {"ranker_blind_smollm2.pt": ("teacher_kept", 1.0, 49, 6),  # retrained 2026-12-06 (issue 42)
               "ranker_blind_kvzip_only_smollm2.pt": ("teacher", 0.0, 50, 15)}
    for name, (target, needle_weight, train_samples, validation_samples) in shipped.items():
        _, summary = load_ranker(policies / name)
        assert summary["target"] == target and summary["needle_weight"] == needle_weight, name
        assert summary["train_samples"] == train_samples and summary["validation_samples"] == validation_samples, name
