"""Exploration (not a kvgym command): could any weighting of the layers make the replay regret rank the fidelity
policies as live KL does? An upper bound, fitted **in sample** (on the episodes it is scored on, so optimistic).

Reads the per-layer regrets of ``variants_seed<SEED>.json`` (``explore_variants.py``) and searches per-layer
weights ≥ 0 (multiplicative random coordinate steps from uniform, 1,500 tries, seeded) that maximise the mean
within-episode Spearman of ``Σ_layer w · regret`` against the live KL.

    python benchmarks/ranker_fidelity_value/fit_layer_weights.py results/ranker_fidelity_value/variants_seed7.json
"""
import gzip
import json
import sys

import numpy as np

from eval.ranking_fidelity import spearman

rows = json.loads(gzip.open(sys.argv[1]).read() if str(sys.argv[1]).endswith('.gz') else open(sys.argv[1]).read())
key = sys.argv[2] if len(sys.argv) > 2 else "layer_max"
episodes: dict = {}
for row in rows:
    episodes.setdefault((row["sample"], row["budget"]), []).append(row)
table = [(np.array([r[key] for r in rs]), [r["live_kl"] for r in rs]) for rs in episodes.values()]


def mean_spearman(weights: np.ndarray) -> float:
    return float(np.mean([spearman(list(regrets @ weights), kl) for regrets, kl in table]))


rng = np.random.default_rng(0)
weights = np.ones(table[0][0].shape[1])
best = uniform = mean_spearman(weights)
for _ in range(1500):
    step = np.exp(rng.normal(0, 0.5, weights.shape) * (rng.random(weights.shape) < 0.2))
    score = mean_spearman(weights * step)
    if score >= best:
        weights, best = weights * step, score
print(f"{key}: {len(table)} episodes; uniform weights {uniform:.3f}; best in-sample weights {best:.3f}")
print("weights (mean 1):", " ".join(f"{w:.2f}" for w in weights / weights.mean()))
