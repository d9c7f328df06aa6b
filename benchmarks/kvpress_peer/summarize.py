"""Tables for issue 42: kvpress's KVzip variants (one difference to kvgym removed at a time) and every kvgym method
beside its kvpress counterpart on the same samples.

    python benchmarks/kvpress_peer/summarize.py results/kvpress_peer/families_heldout_2k \
        [--pair kvzip=kvzip_layerwise_shared ...]
reads FOLDER/kvpress_results.jsonl and every FOLDER/kvgym_*/samples.jsonl (or their .gz); writes FOLDER/summary.md and
FOLDER/summary.json.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from eval.peer import compare, markdown
from eval.report import bootstrap_interval, read_jsonl, records_file, wilson_interval

VARIANTS = ("kvzip", "kvzip_shared", "kvzip_layerwise", "kvzip_layerwise_shared")
DESCRIBED = {"kvzip": "kvpress as shipped: global over layers, per KV head (kvgym's kvzip since 2026-12-06)",
             "kvzip_shared": "global over layers, one token set per layer (kvgym: kvzip:per_head=false)",
             "kvzip_layerwise": "same share per layer, per KV head (kvgym: kvzip:layerwise=true)",
             "kvzip_layerwise_shared": "same share per layer, one token set per layer (kvgym's kvzip before "
                                       "2026-12-06)"}


def kvzip_ablation(rows: list[dict]) -> list[dict]:
    """Per protocol and ratio: each KVzip variant's accuracy (Wilson 95%) and its paired difference to the shipped
    press (bootstrap 95%), on the samples both ran."""
    correct = defaultdict(dict)
    for row in rows:
        correct[(row["protocol"], float(row["ratio"]), row["press"])][int(row["index"])] = bool(row["correct"])
    full = {key[0]: got for key, got in correct.items() if key[2] == "none"}
    table = []
    for protocol, ratio in sorted({(p, r) for p, r, name in correct if name == "kvzip"}):
        shipped = correct[(protocol, ratio, "kvzip")]
        for name in VARIANTS:
            got = correct.get((protocol, ratio, name))
            if not got:
                continue
            common = sorted(set(got) & set(shipped))
            n, right = len(common), sum(got[i] for i in common)
            low, high = wilson_interval(right, n)
            diff_low, diff_high = bootstrap_interval([float(got[i]) - float(shipped[i]) for i in common])
            reference = full.get(protocol, {})
            table.append({"protocol": protocol, "ratio": ratio, "kept": round(1 - ratio, 4), "press": name,
                          "rule": DESCRIBED[name], "n": n, "accuracy": right / n, "ci_low": low, "ci_high": high,
                          "vs_shipped": (right - sum(shipped[i] for i in common)) / n,
                          "vs_shipped_low": diff_low, "vs_shipped_high": diff_high,
                          "full_cache": sum(reference.get(i, False) for i in common) / n if reference else None})
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--pair", action="append", default=[], metavar="SPEC=PRESS")
    args = parser.parse_args()
    peer = args.folder / "kvpress_results.jsonl"
    ablation = kvzip_ablation(read_jsonl(peer))
    lines = ["## KVzip in kvpress, one difference to kvgym at a time", "",
             "| protocol | kept | press | selection | n | full cache | accuracy (95%) | − shipped (paired 95%) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in ablation:
        full = "" if r["full_cache"] is None else f"{r['full_cache']:.3f}"
        lines.append(f"| {r['protocol']} | {r['kept']:g} | {r['press']} | {r['rule']} | {r['n']} | {full} | "
                     f"{r['accuracy']:.3f} ({r['ci_low']:.2f}..{r['ci_high']:.2f}) | {r['vs_shipped']:+.3f} "
                     f"({r['vs_shipped_low']:+.2f}..{r['vs_shipped_high']:+.2f}) |")
    pairs = dict(item.rsplit("=", 1) for item in args.pair)
    agreement = {}
    for folder in sorted(path for path in args.folder.glob("kvgym_*") if path.is_dir()):
        samples = records_file(folder / "samples.jsonl")  # committed compressed
        rows = compare(samples, peer)
        agreement[samples.parent.name] = rows
        lines += ["", f"## kvgym ({samples.parent.name}) beside kvpress's press of the same name", "", markdown(rows)]
        if pairs:
            same_rule = [row for row in compare(samples, peer, pairs) if row["controller"] in pairs]
            agreement[samples.parent.name + " (same selection rule)"] = same_rule
            lines += ["", f"## kvgym ({samples.parent.name}) beside the kvpress variant with its selection rule", "",
                      markdown(same_rule)]
    (args.folder / "summary.md").write_text("\n".join(lines) + "\n")
    (args.folder / "summary.json").write_text(json.dumps({"kvzip_ablation": ablation, "agreement": agreement},
                                                         indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
