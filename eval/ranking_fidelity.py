"""Is the ranking replay faithful? Replay regret against live decoding, policy by policy, within each episode.

An episode is one sample at one budget. For every policy (a keep score per block computed from the block
features: the ranking policy, single heuristic features, random scores) the **replay** side is the mean over
layers of ``ranking_regret`` at the sample's recorded ``oneshot-question`` decision point
(``kvgym.envs.decisions``), and the **live** side applies the same keep scores to the cache at that decision
point and teacher-forces the full cache's greedy answer through the compressed cache (``LiveDecision``, one
forward; tested equal to the runner's step-by-step run): the mean KL from the full cache's next-token
distributions over the answer's positions. Both come from one dense prefill.
Within each episode the two sides rank the policies; ``spearman`` measures their agreement (replay regret and
live KL both fall as a policy gets better, so faithful replay gives +1).

The replay side is computed for each target of ``REPLAY_TARGETS`` from the same live rows: ``replay_regret``
(the future attention, the reward the ranker trains on) and ``replay_regret_future_value`` (the future attention
times the blocks' value norms, ``kvgym.envs.decisions.target_heads``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from cache.controller import CacheView, Decision
from cache.paged_cache import CacheConfig
from cache.ranking import RANK_FEATURES, block_features, keep_top
from cache.runner import Runner
from kvgym.envs.decisions import Decisions, LiveDecision, decision_point


def rankdata(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties get their average rank (``scipy.stats.rankdata``'s default)."""
    values = np.asarray(values, dtype=np.float64)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts
    return (starts + (counts + 1) / 2.0)[inverse]


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation of ``x`` and ``y`` (NaN for fewer than two points or a constant side)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denominator) if denominator > 0 else float("nan")


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson on average ranks); NaN when either side is constant."""
    return pearson(rankdata(x), rankdata(y))


# each replay target of Decisions and the row column its regret goes in
REPLAY_TARGETS = {"future": "replay_regret", "future_value": "replay_regret_future_value"}

# single block features that are a heuristic's ranking (higher = keep)
FEATURE_POLICIES = {
    "tova (last query, mean)": "last_query_mean_rank",
    "last query, max": "last_query_max_rank",
    "window, mean": "last_mean_rank",
    "window, max": "last_max_rank",
    "observed attention, mean": "observed_mean_rank",
    "quest bound, max": "page_bound_max_rank",
    "key norm": "key_norm_rank",
    "key distinctiveness": "key_distinct_rank",
    "recency": "position",
}


class ScoredRanking:
    """A controller from a scoring function of the block features (``[L, N, F]`` tensor → ``[L, N]``
    keep scores): keeps each layer's top-b (``keep_top``)."""

    def __init__(self, score):
        self.score = score

    def decide(self, view: CacheView) -> list[Decision]:
        return keep_top(view, self.score(torch.from_numpy(block_features(view))))


def feature_score(column: str):
    """A ranking that scores blocks by one feature column."""
    index = RANK_FEATURES.index(column)
    return lambda features: features[..., index].float()


def random_score(seed: int):
    """A fixed random ranking: the same scores for every call on features of the same shape, so the replay
    and the live side (and each replay target) score the same ranking."""
    return lambda features: torch.rand(features.shape[:-1], generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def episode_table(model, prompt, policies: dict, budgets, max_new_tokens: int = 24, block_size: int = 16,
                  eos_ids: set[int] | None = None) -> list[dict]:
    """Replay regret and live KL of every policy (name → scoring function) on ``prompt`` at each budget: one
    row per (budget, policy). Both sides score the **same** keep scores (the policy applied to the recorded
    features at that budget); the live side is ``LiveDecision``'s one-forward teacher-forced KL."""
    runner = Runner(model, None, CacheConfig(block_size=block_size), protocol="oneshot-question")
    shared = runner.dense_prefill(prompt, max_new_tokens)
    record = decision_point(model, prompt, max_new_tokens, eos_ids=eos_ids, shared=shared)
    live = LiveDecision(model, prompt, shared, record["answer"].tolist())
    rows = []
    for budget in budgets:
        replays = {column: Decisions([record], budgets=(budget,), target=target) for target, column in REPLAY_TARGETS.items()}
        features = replays[REPLAY_TARGETS["future"]].features  # [L, N, F]: the same rows for every target
        for name, score in policies.items():
            scores = score(features)
            regrets = {column: float(decisions.regret(scores).mean()) for column, decisions in replays.items()}
            start = time.perf_counter()
            kl = live.kl(scores.detach().cpu().numpy(), budget)
            rows.append({"budget": budget, "policy": name, **regrets, "live_kl": kl,
                         "live_s": time.perf_counter() - start})
    return rows


def fidelity_summary(rows: list[dict], replay: str = "replay_regret") -> dict:
    """Per episode (sample, budget): Spearman of the ``replay`` column (a regret of ``REPLAY_TARGETS``) vs live
    KL over the policies; their mean."""
    episodes = {}
    for row in rows:
        episodes.setdefault((row["sample"], row["budget"]), []).append(row)
    per_episode = []
    for (sample, budget), group in sorted(episodes.items()):
        rho = spearman([r[replay] for r in group], [r["live_kl"] for r in group])
        per_episode.append({"sample": sample, "budget": budget, "policies": len(group), "spearman": rho})
    rhos = np.array([e["spearman"] for e in per_episode], np.float64)
    return {"episodes": per_episode, "mean_spearman": float(np.nanmean(rhos)) if len(rhos) else float("nan"),
            "min_spearman": float(np.nanmin(rhos)) if len(rhos) else float("nan")}
