"""Which offline measure agrees with live accuracy on question-blind decisions? For the records of
``collect.py``: each ranking's share of needle blocks kept on device (sample × layer × block holding a gold
answer) and its mean regret under each candidate future (0 = that future's oracle).

    python benchmarks/ranker_blind_replay/analyze.py /tmp/blind > results/ranker_blind_replay/report.txt
"""

import sys
from pathlib import Path

import torch

from agents.ranker.model import load_ranker
from cache.controller import PHASES
from cache.models import load_model
from cache.ranking import PHASE_COLUMNS, RANK_FEATURES
from eval.tasks import generate
from eval.tasks.prompt import _render
from kvgym.envs.decisions import Decisions

LENGTH, SEED, BLOCK = 2048, 102, 16
FEATURE_RANKINGS = ("key_norm_rank", "key_distinct_rank", "last_query_max_rank", "last_mean_rank")


def needle_blocks(tokenizer, record) -> list[int]:
    """The blocks of the chat-rendered prompt that hold a gold answer's characters."""
    sample = generate(record["task"], tokenizer, LENGTH, seed=SEED, index=int(record["index"]))
    rendered = _render(tokenizer, [{"role": "user", "content": sample.input}])
    where = rendered.find(sample.input)
    offsets = tokenizer(rendered, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    blocks = set()
    for answer in sample.outputs:
        at = sample.context.find(answer)
        if at >= 0:
            a, b = where + at, where + at + len(answer)
            blocks |= {i // BLOCK for i, (x, y) in enumerate(offsets) if x < b and y > a}
    return sorted(blocks)


def needle_kept(decisions: Decisions, scores: torch.Tensor, needles: list[list[int]]) -> float:
    layers = len(decisions) // len(needles)
    masked = torch.where(decisions.candidates, scores, torch.tensor(-1e9))
    kept = total = 0
    for i, blocks in enumerate(needles):
        for row in range(i * layers, (i + 1) * layers):
            top = set(torch.argsort(masked[row], descending=True)[: int(decisions.room[row])].tolist())
            candidates = [b for b in blocks if decisions.candidates[row, b]]
            total += len(candidates)
            kept += sum(b in top for b in candidates)
    return kept / max(total, 1)


def main(folder: Path) -> None:
    tokenizer = load_model("smollm2-135m").tokenizer
    model, _ = load_ranker("policies/ranker_smollm2.pt")
    records = [torch.load(path, weights_only=True) for path in sorted(folder.glob("*.pt"))]
    needles = [needle_blocks(tokenizer, record) for record in records]
    variants = list(records[0]["futures"])
    print(f"{len(records)} question-blind decision points (harness seed {SEED}, never reported)")
    for budget in (0.125, 0.25, 0.5):
        decisions = Decisions(records, budgets=(budget,))
        shown_as_compress = decisions.features.clone()
        shown_as_compress[..., PHASE_COLUMNS] = torch.tensor([p == "compress" for p in PHASES], dtype=torch.float32)
        with torch.no_grad():
            scores = {"ranker (prefill view)": model(decisions.features)[0],
                      "ranker (compress view)": model(shown_as_compress)[0]}
        scores.update({name: decisions.features[..., RANK_FEATURES.index(name)] for name in FEATURE_RANKINGS})
        regret = {variant: Decisions([{**r, "future_heads": r["futures"][variant]} for r in records], (budget,))
                  for variant in variants}
        print(f"\nbudget {budget}: needle kept, and mean regret under each future")
        print(f"  {'ranking':24s} {'needle':>7s} " + " ".join(f"{v:>11s}" for v in variants))
        for name, score in scores.items():
            regrets = " ".join(f"{float(regret[v].regret(score).mean()):11.4f}" for v in variants)
            print(f"  {name:24s} {needle_kept(decisions, score, needles):7.3f} {regrets}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
