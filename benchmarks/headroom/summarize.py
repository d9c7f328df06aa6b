"""Issue 40's headroom question per (task, budget) cell of the grid: the full cache, every method, the best baseline
(KVzip included, and among the baselines of plain-prefill cost) and the gap between the full cache and it; the
policy against the cell's best baseline (paired bootstrap, 95%); each method's MB moved between tiers per generated
token beside it, and with ``--ttft`` its time to first token (only for grids run without ``--batch-runs``: batched
runs advance in lockstep, so their times are not each method's). A cell counts only where the full cache scores
>= --min-full on the same samples.

    python benchmarks/headroom/summarize.py out/headroom_2k_oneshotq --json results/headroom_2k_oneshotq/headroom.json
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from eval.report import bootstrap_interval, unique_records

EXTRA_PASSES = ("kvzip",)  # baselines that cost more than a plain prefill (context reconstruction)
POLICIES = ("ranker",)  # the learned policy is not a baseline


def cells(records: list[dict], min_full: float) -> list[dict]:
    """One row per (task, length, budget): accuracies on the samples every method of the cell ran."""
    by_cell, full = defaultdict(lambda: defaultdict(dict)), defaultdict(dict)
    costs = defaultdict(lambda: defaultdict(list))  # (task, length, budget) -> method -> [(ttft s, MB per token)]
    for record in records:
        if record["controller"] == "full":
            full[record["task"], record["length"]][record["index"]] = record["score"]
        else:
            cell = record["task"], record["length"], record["budget"]
            by_cell[cell][record["controller"]][record["index"]] = record["score"]
            costs[cell][record["controller"]].append((record.get("ttft_ms", 0.0) / 1000,
                                                       record.get("bytes_moved_per_token", 0.0) / 1e6))
    rows = []
    for (task, length, budget), methods in sorted(by_cell.items()):
        common = set(full[task, length]).intersection(*(set(scores) for scores in methods.values()))
        if not common:
            continue
        mean = {name: sum(scores[i] for i in common) / len(common) for name, scores in methods.items()}
        full_mean = sum(full[task, length][i] for i in common) / len(common)
        baselines = {name: value for name, value in mean.items() if not name.startswith(POLICIES)}
        plain = {name: value for name, value in baselines.items() if not name.startswith(EXTRA_PASSES)}
        best, best_plain = max(baselines, key=baselines.get), max(plain, key=plain.get)
        paired = {}
        for name in (name for name in methods if name.startswith(POLICIES)):
            diffs = [methods[name][i] - methods[best][i] for i in sorted(common)]
            low, high = bootstrap_interval(diffs)
            paired[name] = {"diff": sum(diffs) / len(diffs), "low": low, "high": high,
                            "won": sum(d > 0 for d in diffs), "lost": sum(d < 0 for d in diffs)}
        cost = {name: {"ttft_s": sum(t for t, _ in pairs) / len(pairs), "mb_moved_per_token": sum(m for _, m in pairs) / len(pairs)}
                for name, pairs in costs[task, length, budget].items()}
        rows.append({"task": task, "length": length, "budget": budget, "compression": round(1 / budget), "n": len(common),
                     "full": full_mean, "counts": full_mean >= min_full, "methods": mean,
                     "best_baseline": best, "gap": full_mean - baselines[best],
                     "best_plain_baseline": best_plain, "gap_plain": full_mean - plain[best_plain],
                     "policy_vs_best": paired, "cost": cost})
    return rows


def markdown(rows: list[dict], ttft: bool = False) -> str:
    """The cells as a table; a cell whose full cache is below the bar is marked and does not count."""
    lines = ["| task | compression | n | full | best baseline | gap | best plain-prefill baseline | gap | policy | "
             "policy − best baseline (95%; won / lost) | counts |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        policy = " / ".join(f"{value:.2f}" for name, value in row["methods"].items() if name.startswith(POLICIES))
        paired = " / ".join(f"{p['diff']:+.2f} ({p['low']:+.2f}..{p['high']:+.2f}; {p['won']} / {p['lost']})"
                            for p in row.get("policy_vs_best", {}).values())
        lines.append(f"| {row['task']} | {row['compression']}× | {row['n']} | {row['full']:.2f} | "
                     f"{row['best_baseline']} {row['methods'][row['best_baseline']]:.2f} | {row['gap']:+.2f} | "
                     f"{row['best_plain_baseline']} {row['methods'][row['best_plain_baseline']]:.2f} | "
                     f"{row['gap_plain']:+.2f} | {policy} | {paired} | {'yes' if row['counts'] else 'no (full below the bar)'} |")
    methods = sorted({name for row in rows for name in row.get("cost", {})})
    if methods:  # costs over every cell a method ran, each cell weighted alike
        lines += ["", "| method | MB moved per generated token |" + (" time to first token (s) |" if ttft else ""),
                  "|---|---|" + ("---|" if ttft else "")]
        for name in methods:
            cells_run = [row["cost"][name] for row in rows if name in row.get("cost", {})]
            line = f"| {name} | {sum(c['mb_moved_per_token'] for c in cells_run) / len(cells_run):.2f} |"
            if ttft:
                line += f" {sum(c['ttft_s'] for c in cells_run) / len(cells_run):.1f} |"
            lines.append(line)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--min-full", type=float, default=0.8)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--ttft", action="store_true", help="also each method's time to first token (unbatched grids)")
    args = parser.parse_args()
    records = unique_records(args.folder / "samples.jsonl")
    rows = cells(records, args.min_full)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    table = markdown(rows, args.ttft)
    args.json.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
