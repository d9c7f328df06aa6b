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
    assert all(row["fallbacks"] == 0 and row["live_kl"] >= -1e-6 for row in rows)
    tight = [row for row in rows if row["budget"] == 4]
    whole = [row for row in rows if row["budget"] == 64]
    # room for every block: no regret, and the live run reproduces the full cache's distributions
    assert all(row["replay_regret"] < 1e-6 and row["live_kl"] < 1e-5 for row in whole)
    # negative control: with 4 blocks a layer the policies lose mass and diverge from the full cache
    assert all(row["replay_regret"] > 0 for row in tight) and min(row["live_kl"] for row in tight) > 1e-4


def test_fidelity_summary_is_the_within_episode_rank_agreement():
    rows = [{"sample": "a", "budget": 0.25, "policy": str(i), "replay_regret": i / 10, "live_kl": i ** 2}
            for i in range(8)]
    rows += [{"sample": "b", "budget": 0.25, "policy": str(i), "replay_regret": i / 10, "live_kl": -i}
             for i in range(8)]
    summary = fidelity_summary(rows)
    assert [e["spearman"] for e in summary["episodes"]] == pytest.approx([1.0, -1.0])
    assert summary["mean_spearman"] == pytest.approx(0.0) and summary["min_spearman"] == pytest.approx(-1.0)
    assert math.isnan(fidelity_summary([])["mean_spearman"])
