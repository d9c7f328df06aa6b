"""Paired differences between runs recorded in different ``kvgym eval`` folders or files (e.g. one setting against
another, or a retrained policy against the shipped one's committed records), matched by sample (task, length,
sample hash) and budget: mean difference, paired-bootstrap 95% interval, won / tied / lost (``eval.report``).

    python -m benchmarks.paired_records --controller ranker@global \\
        out/heldout_stream_2k_plain_global/samples.jsonl@global results/generalization/heldout_stream_2k_plain_qstay_samples.jsonl.gz

Each file may carry ``@LABEL``: its controllers' names get ``@LABEL`` appended, so the same controller run under two
settings compares as two. ``--controller`` names the row to compare (a prefix of a labelled name is enough when it
picks one); every other controller of the files is compared with it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.report import paired_differences, paired_differences_md, unique_records


def labelled(spec: str) -> list[dict]:
    path, _, label = spec.partition("@")
    records = unique_records(Path(path))
    for record in records:
        if label and record["controller"] != "full":
            record["controller"] = f"{record['controller']}@{label}"
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="samples.jsonl[.gz] files, each optionally with @LABEL")
    parser.add_argument("--controller", required=True, help="the controller to compare (or a unique prefix, label included)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    records = [record for spec in args.files for record in labelled(spec)]
    names = sorted({r["controller"] for r in records})
    prefix, _, label = args.controller.partition("@")
    chosen = [name for name in names if name == args.controller] or [
        name for name in names if name.startswith(prefix) and (not label or name.endswith(f"@{label}"))]
    if len(chosen) != 1:
        raise SystemExit(f"--controller {args.controller!r} picks {len(chosen)} of: {', '.join(names)}")
    rows = paired_differences(records, chosen[0])
    print(f"{chosen[0]} against the rest\n\n{paired_differences_md(rows)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
