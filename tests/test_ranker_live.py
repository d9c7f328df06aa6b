"""Policy gradient on the live reward (agents.ranker.live_train) on the tiny random Llama."""

import json

import pytest
import torch

from agents.ranker.live_train import LivePoint, evaluate, train_live
from agents.ranker.model import BlockScorer, load_ranker, save_ranker
from cache.paged_cache import CacheConfig
from cache.ranking import RANK_FEATURES
from cache.runner import Prompt, Runner
from kvgym.envs.decisions import Decisions, LiveDecision, decision_point

PROMPTS = [Prompt(torch.randint(2, 256, (200,), generator=torch.Generator().manual_seed(s)).tolist(), context_end=180)
           for s in range(3)]


class HalfWanted:
    """A stand-in live reward with a known best ranking: the KL is the share of the candidates kept that lie
    outside the wanted half of the context (``old``: keeping the oldest blocks is best, else the newest)."""

    def __init__(self, record, old: bool):
        self.record, self.old = record, old

    def kl(self, scores, budget):
        decisions = Decisions([self.record], budgets=(budget,))
        keyed = torch.where(decisions.candidates, torch.as_tensor(scores).float(), torch.tensor(-torch.inf))
        kept = torch.zeros_like(decisions.candidates)
        for layer, room in enumerate(decisions.room.tolist()):
            kept[layer, keyed[layer].topk(room).indices] = True
        n = decisions.candidates.shape[1]
        unwanted = kept[:, n // 2:] if self.old else kept[:, : n // 2]
        return float(unwanted.sum() / kept.sum().clamp(min=1))


def _start_file(tmp_path, records):
    scorer = BlockScorer(len(RANK_FEATURES), 16)
    scorer.set_normalisation(torch.cat([Decisions([r]).features.flatten(0, 1) for r in records]))
    return save_ranker(scorer, tmp_path / "start.pt")


@pytest.mark.parametrize("one_layer", [False, True])
def test_policy_gradient_on_a_live_reward_learns_its_best_ranking(tiny_model, tmp_path, one_layer):
    records = [decision_point(tiny_model, prompt, max_new_tokens=4) for prompt in PROMPTS]
    start = _start_file(tmp_path, records)
    # the half the untrained scorer keeps least of is the one wanted: a start far from the best ranking
    by_half = {old: [LivePoint(f"p{i}", r, HalfWanted(r, old)) for i, r in enumerate(records)] for old in (True, False)}
    before, points = max(((evaluate(load_ranker(start)[0], p, (0.25,))["kl"], p) for p in by_half.values()),
                         key=lambda pair: pair[0])
    assert before >= 0.5
    summary = train_live(points[:2], points[2:], start, tmp_path / "run", budgets=(0.25,), epochs=15, samples=8,
                         lr=1e-2, one_layer=one_layer, log=lambda *_: None)
    trained, info = load_ranker(tmp_path / "run" / "ranker.pt")
    after = evaluate(trained, points, (0.25,))["kl"]
    assert after < before - 0.2 and after < 0.2  # held-out point included
    assert info["live_training"]["best"]["epoch"] == summary["best"]["epoch"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(16)) and rows[0]["train_sampled_kl"] is None
    assert all(0 <= r["flat_groups"] <= 1 for r in rows[1:])
    assert list((tmp_path / "run" / "tensorboard").iterdir())


def test_evaluate_scores_the_deterministic_top_b_live(tiny_model, tmp_path):
    """With the real live reward: the start file's mean KL is the KL of its top-b at each budget."""
    runner = Runner(tiny_model, None, CacheConfig(block_size=16), protocol="oneshot-question")
    shared = runner.dense_prefill(PROMPTS[0], 4)
    record = decision_point(tiny_model, PROMPTS[0], 4, shared=shared)
    live = LiveDecision(tiny_model, PROMPTS[0], shared, record["answer"].tolist())
    scorer = load_ranker(_start_file(tmp_path, [record]))[0]
    result = evaluate(scorer, [LivePoint("p", record, live)], (0.125, 0.5))
    expected = [live.kl(scorer(Decisions([record], budgets=(b,)).features)[0].detach(), b) for b in (0.125, 0.5)]
    assert result["kls"] == pytest.approx(expected) and result["kls"][0] > result["kls"][1] > 0
    with pytest.raises(ValueError, match="samples"):
        train_live([], [], tmp_path / "start.pt", tmp_path / "bad", samples=1)
