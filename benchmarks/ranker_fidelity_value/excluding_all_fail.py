"""Exploration (not a kvgym command): replay fidelity without the episodes in which every ranking loses the
answer (the best live KL of the episode ≥ ``ALL_FAIL_KL`` nats). The threshold was chosen after looking at seeds 7
and 9; seed 13 (collected after it was fixed) is its test. Reads output_error.py's JSONs (their rows carry the
live KL and every replay measure) and prints each measure's mean within-episode Spearman on all episodes and on
the rest.

    python benchmarks/ranker_fidelity_value/excluding_all_fail.py results/ranker_fidelity_value/output_sketch256_seed13.json
"""
import gzip
import json
import sys

from eval.ranking_fidelity import fidelity_summary

ALL_FAIL_KL = 0.5
MEASURES = {"replay_regret": "replay regret (the env's reward)", "proj_abs": "exact per-layer output after o_proj",
            "lin": "linear, no renormalisation", "sketch_head_denom": "sketch, per head renormalised"}

for path in sys.argv[1:]:
    rows = json.loads(gzip.open(path).read() if str(path).endswith('.gz') else open(path).read())["rows"]
    best = {}
    for row in rows:
        episode = (row["sample"], row["budget"])
        best[episode] = min(best.get(episode, float("inf")), row["live_kl"])
    failing = sorted(e for e, kl in best.items() if kl >= ALL_FAIL_KL)
    kept = [r for r in rows if best[(r["sample"], r["budget"])] < ALL_FAIL_KL]
    print(f"{path}: {len(best)} episodes, all-fail (best live KL >= {ALL_FAIL_KL}): {failing}")
    for measure, name in MEASURES.items():
        every, rest = fidelity_summary(rows, measure), fidelity_summary(kept, measure)
        above = sum(e["spearman"] >= 0.8 for e in rest["episodes"])
        print(f"  {name:40s} all {every['mean_spearman']:.3f}   without all-fail {rest['mean_spearman']:.3f} "
              f"({above}/{len(rest['episodes'])} episodes >= 0.8)")
