"""Replay vs live for the ranking action (eval.ranking_fidelity) on the tiny random Llama."""

import math

import pytest
import torch

from cache.runner import Prompt
from eval.ranking_fidelity import (
    FEATURE_POLICIES,
    episode_table,
    feature_score,
    fidelity_summary,
    random_score,
)

PROMPT = Prompt(torch.randint(2, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist(), context_end=180)


def test_episode_table_scores_every_policy_on_both_sides(tiny_model):
    policies = {name: feature_score(column) for name, column in FEATURE_POLICIES.items()} | {"random": random_score(0)}
    rows = episode_table(tiny_model, PROMPT, policies, budgets=[4, 64], max_new_tokens=6)
    assert len(rows) == 2 * len(policies) >= 2 * 8
    assert all(row["live_kl"] >= -1e-6 for row in rows)
    tight = [row for row in rows if row["budget"] == 4]
    whole = [row for row in rows if row["budget"] == 64]
    # room for every block: no regret, and the live run reproduces the full cache's distributions
    assert all(row["replay_regret"] < 1e-6 and row["live_kl"] < 1e-5 for row in whole)
    # negative control: with 4 blocks a layer the policies lose mass and diverge from the full cache
    assert all(row["replay_regret"] > 0 for row in tight) and min(row["live_kl"] for row in tight) > 1e-4
    # the value-weighted replay is scored on the same rows, and is a different number
    assert all(row["replay_regret_future_value"] < 1e-6 for row in whole)
    assert any(abs(row["replay_regret_future_value"] - row["replay_regret"]) > 1e-4 for row in tight)


def test_fidelity_summary_is_the_within_episode_rank_agreement():
    rows = [{"sample": "a", "budget": 0.25, "policy": str(i), "replay_regret": i / 10, "live_kl": i ** 2}
            for i in range(8)]
    rows += [{"sample": "b", "budget": 0.25, "policy": str(i), "replay_regret": i / 10, "live_kl": -i}
             for i in range(8)]
    summary = fidelity_summary(rows)
    assert [e["spearman"] for e in summary["episodes"]] == pytest.approx([1.0, -1.0])
    assert summary["mean_spearman"] == pytest.approx(0.0) and summary["min_spearman"] == pytest.approx(-1.0)
    assert math.isnan(fidelity_summary([])["mean_spearman"])
    for row in rows:
        row["replay_regret_future_value"] = -row["replay_regret"]
    assert fidelity_summary(rows, "replay_regret_future_value")["mean_spearman"] == pytest.approx(0.0)
    assert [e["spearman"] for e in fidelity_summary(rows, "replay_regret_future_value")["episodes"]] == pytest.approx([-1.0, 1.0])


def test_the_random_policy_is_one_fixed_ranking_on_both_sides():
    score = random_score(3)
    features = torch.zeros(2, 10, 5)
    assert torch.equal(score(features), score(features))  # replay and live see the same ranking
    assert not torch.equal(score(features), random_score(4)(features))


def test_live_decision_kl_is_the_runners_teacher_forced_kl_in_one_forward(tiny_model):
    """Independent reference: the runner's step-by-step teacher-forced run with the same ranking as its
    controller (eval.harness.kl_divergence against the full cache's run); negative control: other scores."""
    from cache.paged_cache import CacheConfig
    from cache.runner import Runner
    from eval.harness import kl_divergence
    from eval.ranking_fidelity import ScoredRanking
    from kvgym.envs.decisions import LiveDecision, decision_point

    runner = Runner(tiny_model, None, CacheConfig(block_size=16), protocol="oneshot-question")
    shared = runner.dense_prefill(PROMPT, 6)
    answer = decision_point(tiny_model, PROMPT, 6, shared=shared)["answer"].tolist()
    live = LiveDecision(tiny_model, PROMPT, shared, answer)
    reference = torch.stack(runner.run(PROMPT, forced_tokens=answer, keep_logits=True, shared=shared).logits)
    for seed in (0, 1):
        score = random_score(seed)
        stepwise = Runner(tiny_model, None, CacheConfig(block_size=16), controller=ScoredRanking(score), budget=0.25,
                          protocol="oneshot-question").run(PROMPT, forced_tokens=answer, keep_logits=True, shared=shared)
        expected = float(kl_divergence(reference, torch.stack(stepwise.logits)).mean())
        assert expected > 1e-4
        assert live.kl(score(torch.zeros(2, 13, 1)), 0.25) == pytest.approx(expected, rel=1e-3, abs=1e-6)
    assert live.kl(random_score(0)(torch.zeros(2, 13, 1)), 0.25) != pytest.approx(
        live.kl(random_score(1)(torch.zeros(2, 13, 1)), 0.25), rel=1e-3)
    assert live.kl(torch.zeros(2, 13), 64) < 1e-9  # 64 blocks a layer, room for everything: the full cache's distributions
