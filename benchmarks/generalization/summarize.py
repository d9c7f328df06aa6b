"""The leave-family-out table (issue 36) from `kvgym eval` folders: per folder and budget, on the samples every
method ran, the full cache, the oracles, each heuristic, each learned policy, and for each policy its paired
difference from the best heuristic of the cell (bootstrap 95% interval over samples), its share of the full cache
and the share of the prefetching oracle's gain over the best heuristic it captures (bootstrap interval of the ratio
of means).

    python benchmarks/generalization/summarize.py out/a+out/a_policy ... --json results/generalization/summary.json

The best heuristic is picked per cell on the reported samples themselves (the comparison most favourable to it).
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

from eval.report import unique_records

ORACLE = "oracle:prefetch=true"


def kind(controller: str) -> str:
    if controller == "full":
        return "full"
    if controller.startswith("oracle"):
        return "oracle"
    if controller.startswith("ranker"):
        return "policy"
    return "heuristic"


def bootstrap(samples: list[str], statistic, boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    values = sorted(v for v in (statistic(rng.choices(samples, k=len(samples))) for _ in range(boot)) if v is not None)
    if not values:
        return float("nan"), float("nan")
    return values[int(0.025 * len(values))], values[min(int(0.975 * len(values)), len(values) - 1)]


def cell_rows(cell: str) -> list[dict]:
    """``cell``: one eval folder, or several joined by ``+`` (the same settings; their records are joined by key)."""
    folders = [Path(part) for part in cell.split("+")]
    records = unique_records([f / "samples.jsonl" for f in folders])
    configs = [json.loads((f / "eval_config.json").read_text()) for f in folders]
    keys = {k for c in configs for k in c}  # a key an older kvgym did not write counts as its default (None)
    configs = [{k: c.get(k) for k in sorted(keys)} for c in configs]
    if any(c != configs[0] for c in configs):
        raise ValueError(f"{cell}: the folders were run with different settings")
    config, folder = configs[0], folders[0]
    scores: dict[str, dict[str, float]] = defaultdict(dict)  # "controller@budget" -> sample -> score
    full: dict[str, float] = {}
    budgets = sorted({float(r["budget"]) for r in records if r["controller"] != "full"})
    for r in records:
        sample = f'{r["task"]}/{r["length"]}/{r.get("sample_hash") or r["index"]}'
        if r["controller"] == "full":
            full[sample] = float(r["score"])
        else:
            scores[f'{r["controller"]}@{float(r["budget"]):g}'][sample] = float(r["score"])
    rows = []
    for budget in budgets:
        methods = {name.rsplit("@", 1)[0]: got for name, got in scores.items() if name.endswith(f"@{budget:g}")}
        common = sorted(set(full).intersection(*map(set, methods.values())))
        if not common:
            continue

        def mean(table, chosen):
            return sum(table[s] for s in chosen) / len(chosen)
        heuristics = {m: mean(t, common) for m, t in methods.items() if kind(m) == "heuristic"}
        best = max(heuristics, key=heuristics.get) if heuristics else None
        row = {"folder": folder.name, "protocol": config.get("protocol"), "chat": config.get("chat"),
               "budget": budget, "n": len(common), "full": mean(full, common),
               "methods": {m: mean(t, common) for m, t in methods.items()}, "best_heuristic": best}
        oracle = methods.get(ORACLE)
        for policy in (m for m in methods if kind(m) == "policy" and best is not None):
            mine, theirs = methods[policy], methods[best]

            def difference(chosen, mine=mine, theirs=theirs):
                return mean(mine, chosen) - mean(theirs, chosen)

            def captured(chosen, mine=mine, theirs=theirs, oracle=oracle):
                gain = mean(oracle, chosen) - mean(theirs, chosen)
                return None if gain <= 0 else (mean(mine, chosen) - mean(theirs, chosen)) / gain

            entry = {"minus_best": difference(common), "minus_best_ci": bootstrap(common, difference),
                     "of_full": mean(mine, common) / row["full"] if row["full"] else None}
            if oracle is not None:
                entry["captured"] = captured(common)
                entry["captured_ci"] = bootstrap(common, captured)
            row[f"policy {policy}"] = entry
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| cell | budget | n | full | oracle (prefetch) | best heuristic | policy | policy − best (95%) | "
             "captured of oracle's gain (95%) | of full |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        best = row["best_heuristic"]
        for key in (k for k in row if k.startswith("policy ")):
            policy = key.removeprefix("policy ")
            e = row[key]
            oracle = row["methods"].get(ORACLE)
            of_full = "–" if e["of_full"] is None else format(e["of_full"], ".0%")
            captured = "–" if e.get("captured") is None else \
                f'{e["captured"]:.0%} ({e["captured_ci"][0]:.0%}..{e["captured_ci"][1]:.0%})'
            lines.append(
                f'| {row["folder"]} | {row["budget"]:g} | {row["n"]} | {row["full"]:.3f} | '
                f'{"–" if oracle is None else format(oracle, ".3f")} | {best} {row["methods"][best]:.3f} | '
                f'{policy} {row["methods"][policy]:.3f} | {e["minus_best"]:+.3f} ({e["minus_best_ci"][0]:+.2f}..'
                f'{e["minus_best_ci"][1]:+.2f}) | {captured} | '
                f'{of_full} |')
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="eval folders; FOLDER+FOLDER joins the runs of one cell")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [row for folder in args.folders for row in cell_rows(folder)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
