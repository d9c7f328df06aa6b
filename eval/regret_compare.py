"""Rankings compared by their replay regret on held-out decision points, with intervals over samples.

``python -m benchmarks.ranker_tools train`` picks its checkpoint on a validation set, so the regret it reports there is slightly
optimistic. This module scores finished ranker files (and the single-feature heuristics) on a third set of
decision points that no training step or checkpoint choice has seen, and compares each ranking with a
reference (e.g. the warm start): the **fraction of the reference's gap to the oracle it closes**,
``1 - regret / reference regret`` (the oracle's regret is 0), with a paired bootstrap 95% interval that
resamples whole task samples (a sample's layers, budgets and streaming states are not independent).
"""

from __future__ import annotations

import random

import torch

from cache.controller import PHASES
from kvgym.envs.decisions import BUDGETS, Decisions


def gap_closed(decisions: Decisions, scores: torch.Tensor, reference: torch.Tensor, boot: int = 4000,
               seed: int = 0) -> dict[str, float]:
    """``1 - regret(scores) / regret(reference)`` over all rows, its paired-bootstrap 95% interval over
    samples (``boot`` resamples, seeded), and the samples where ``scores`` leave less / more regret."""
    samples = int(decisions.sample.max()) + 1
    mine = torch.zeros(samples).index_add_(0, decisions.sample, decisions.regret(scores)).tolist()
    theirs = torch.zeros(samples).index_add_(0, decisions.sample, decisions.regret(reference)).tolist()
    if sum(theirs) <= 0:
        raise ValueError("gap_closed: the reference ranking has no regret on these decisions (it is the oracle)")
    rng = random.Random(seed)
    draws = []
    for _ in range(boot):
        picked = rng.choices(range(samples), k=samples)
        draws.append(1 - sum(mine[i] for i in picked) / max(sum(theirs[i] for i in picked), 1e-12))
    draws.sort()
    return {"gap_closed": 1 - sum(mine) / sum(theirs), "ci_low": draws[int(0.025 * boot)],
            "ci_high": draws[min(int(0.975 * boot), boot - 1)], "samples": samples,
            "better": sum(a < b for a, b in zip(mine, theirs, strict=True)),
            "worse": sum(a > b for a, b in zip(mine, theirs, strict=True))}


def compare_rankings(decisions: Decisions, rankings: dict[str, torch.Tensor], reference: str) -> dict:
    """Every ranking's regret table (``Decisions.regret_by``) and, for each but ``reference``, ``gap_closed`` against it."""
    if reference not in rankings:
        raise ValueError(f"reference {reference!r} is not one of the rankings: {', '.join(rankings)}")
    return {"reference": reference, "rows": len(decisions), "samples": int(decisions.sample.max()) + 1,
            "regret": {name: decisions.regret_by(scores) for name, scores in rankings.items()},
            "against_reference": {name: gap_closed(decisions, scores, rankings[reference])
                                  for name, scores in rankings.items() if name != reference}}


def comparison_md(report: dict) -> str:
    """The report of ``compare_rankings`` as two Markdown tables."""
    first = next(iter(report["regret"].values()))
    columns = [c for c in (*PHASES, *map(str, BUDGETS), "all") if c in first]
    lines = ["| ranking | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, table in sorted(report["regret"].items(), key=lambda item: item[1]["all"]):
        lines.append(f"| {name} | " + " | ".join(f"{table[c]:.4f}" for c in columns) + " |")
    lines += ["", f"Against `{report['reference']}` ({report['samples']} samples, {report['rows']} decisions): "
              "fraction of its gap to the oracle closed, paired bootstrap 95% interval over samples", "",
              "| ranking | gap closed | 95% CI | samples better / worse |", "|---|---|---|---|"]
    for name, row in report["against_reference"].items():
        lines.append(f"| {name} | {row['gap_closed']:+.1%} | {row['ci_low']:+.1%} .. {row['ci_high']:+.1%} | "
                     f"{row['better']} / {row['worse']} |")
    return "\n".join(lines) + "\n"


def live_kl_comparison(kls: dict[str, list[float]], samples: list[str], reference: str, boot: int = 4000,
                       seed: int = 0) -> dict:
    """Live KL of several rankings on the same decision points (``kls``: name → one KL per point, in the order
    of ``samples``, which names each point's task sample; a sample may have several points, one per budget):
    each one's mean, and against ``reference`` the mean difference (negative: closer to the full cache), its
    paired-bootstrap 95% interval over samples (``boot`` resamples, seeded), and the samples better / worse."""
    if reference not in kls:
        raise ValueError(f"reference {reference!r} is not one of the rankings: {', '.join(kls)}")
    if any(len(values) != len(samples) for values in kls.values()):
        raise ValueError("live_kl_comparison: every ranking needs one KL per decision point")
    names = sorted(set(samples), key=samples.index)
    per_sample = {name: [sum(v for v, s in zip(values, samples, strict=True) if s == sample) for sample in names]
                  for name, values in kls.items()}
    rng = random.Random(seed)
    picks = [rng.choices(range(len(names)), k=len(names)) for _ in range(boot)]
    points_per_sample = len(samples) / len(names)
    against = {}
    for name, totals in per_sample.items():
        if name == reference:
            continue
        diffs = [a - b for a, b in zip(totals, per_sample[reference], strict=True)]
        draws = sorted(sum(diffs[i] for i in pick) / len(pick) / points_per_sample for pick in picks)
        against[name] = {"difference": sum(diffs) / len(samples), "ci_low": draws[int(0.025 * boot)],
                         "ci_high": draws[min(int(0.975 * boot), boot - 1)],
                         "better": sum(d < 0 for d in diffs), "worse": sum(d > 0 for d in diffs)}
    return {"reference": reference, "samples": len(names), "points": len(samples),
            "mean_kl": {name: sum(values) / len(values) for name, values in kls.items()}, "against_reference": against}
