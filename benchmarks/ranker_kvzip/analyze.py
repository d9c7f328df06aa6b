"""Offline check of rankers on question-blind (``oneshot``) decision points recorded with KVzip's scores as a
teacher (``python -m benchmarks.ranker_tools collect --blind --blind-only --teacher kvzip``, validation seed 102): per budget, each
ranking's share of needle blocks kept on device (the measure that agreed with live accuracy in
``results/ranker_blind_replay``), its overlap with KVzip's kept set, and its regret against KVzip's scores.

    python benchmarks/ranker_kvzip/analyze.py data/ranker_kvzip/validation policies/ranker_smollm2.pt runs/X/ranker.pt
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ranker_blind_replay"))
from analyze import needle_blocks, needle_kept  # noqa: E402  (the same needle measure as that report)

from agents.ranker.model import load_ranker  # noqa: E402
from cache.models import load_model  # noqa: E402
from cache.ranking import RANK_FEATURES  # noqa: E402
from kvgym.envs.decisions import Decisions, load_records  # noqa: E402

FEATURE_RANKINGS = {"Knorm (key_norm_rank)": "key_norm_rank", "KeyDiff (key_distinct_rank)": "key_distinct_rank",
                    "TOVA-like (last_query_max_rank)": "last_query_max_rank"}


def kept_sets(decisions: Decisions, scores: torch.Tensor) -> torch.Tensor:
    keyed = torch.where(decisions.candidates, scores.float(), torch.tensor(-torch.inf))
    order = keyed.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    return decisions.candidates & (rank < decisions.room[:, None])


def main(folder: Path, rankers: list[str]) -> None:
    tokenizer = load_model("smollm2-135m").tokenizer
    records = load_records(sorted(folder.glob("*.pt")))
    needles = [needle_blocks(tokenizer, record) for record in records]
    print(f"{len(records)} question-blind decision points ({folder})")
    for budget in (0.125, 0.25, 0.5):
        decisions = Decisions(records, budgets=(budget,), target="teacher")
        scores = {"KVzip (the teacher)": decisions.mass}
        scores |= {name: decisions.features[..., RANK_FEATURES.index(column)] for name, column in FEATURE_RANKINGS.items()}
        for path in rankers:
            model, _ = load_ranker(path)
            with torch.no_grad():
                scores[path] = model(decisions.features)[0]
        teacher = kept_sets(decisions, decisions.mass)
        print(f"\nbudget {budget}: {'needle kept':>11s} {'KVzip overlap':>13s} {'KVzip regret':>12s}")
        for name, score in scores.items():
            kept = kept_sets(decisions, score)
            overlap = float(((kept & teacher).sum(-1) / teacher.sum(-1).clamp(min=1)).mean())
            regret = float(decisions.regret(score.float()).mean())
            print(f"  {name:40s} {needle_kept(decisions, score.float(), needles):11.3f} {overlap:13.3f} {regret:12.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
