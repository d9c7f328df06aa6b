"""Long generation (``run_longgen.sh``): mean perplexity, KL to the full cache and top-1 agreement per method, and
the policy's KL paired against each other method (bootstrap 95% interval over samples, 5,000 resamples, seed 0).

    python benchmarks/headroom/summarize_longgen.py out/headroom_2k_longgen --json results/headroom_2k_longgen/summary.json
"""

import argparse
import json
import random
import statistics
from collections import defaultdict
from pathlib import Path

from eval.report import unique_records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    by = defaultdict(dict)
    for record in unique_records(args.folder / "samples.jsonl"):
        by[record["controller"]][record["index"]] = record
    policy = next(name for name in by if name.startswith("ranker"))
    report = {"methods": {}, "paired_kl_vs_policy": {}}
    for name, runs in by.items():
        report["methods"][name] = {
            "n": len(runs), "perplexity": round(statistics.mean(r["perplexity"] for r in runs.values()), 3),
            "kl": round(statistics.mean(r["kl"] for r in runs.values()), 4),
            "top1_agreement": round(statistics.mean(r["score"] for r in runs.values()), 4)}
    rng = random.Random(0)
    for name in by:
        if name in ("full", policy):
            continue
        common = sorted(set(by[name]) & set(by[policy]))
        diffs = [by[policy][i]["kl"] - by[name][i]["kl"] for i in common]
        means = sorted(statistics.mean(rng.choice(diffs) for _ in diffs) for _ in range(5000))
        report["paired_kl_vs_policy"][name] = {"policy_minus_it": round(statistics.mean(diffs), 4),
                                               "ci95": [round(means[124], 4), round(means[4874], 4)],
                                               "policy_lower_in": sum(d < 0 for d in diffs), "n": len(diffs)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
