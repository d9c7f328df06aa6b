"""Give a policy's committed runs the name its file has now (a file moved or shipped under another path), without
running them again: each record of ``--from`` becomes ``--to`` only if the ``controller_digest`` it carries (the
sha256 of the file it read, ``eval.records.controller_digest``) equals the digest of the file ``--to`` names.
Records of other controllers pass unchanged; a record without a digest, or of another file, is refused.

    python -m benchmarks.relabel_records out/run/samples.jsonl out/renamed/samples.jsonl \\
        --from ranker:runs/window_vote/policy.pt,stay=2 --to ranker:policies/ranker_smollm2.pt,stay=2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.records import controller_digest
from eval.report import unique_records


def relabel(records: list[dict], old: str, new: str) -> list[dict]:
    """``records`` with the controller ``old`` renamed ``new`` (checked by digest); ``ValueError`` otherwise."""
    digest = controller_digest(new)
    if digest is None:
        raise ValueError(f"--to {new!r} names no file to check the records' digests against")
    renamed = []
    for record in records:
        if record["controller"] == old:
            if record.get("controller_digest") != digest:
                raise ValueError(f"a record of {old!r} ({record['task']} #{record['index']}, budget {record['budget']}) "
                                 f"read a file of digest {record.get('controller_digest')!r}, not {new!r}'s {digest}")
            record = {**record, "controller": new}
        renamed.append(record)
    if not any(r["controller"] == new for r in renamed):
        raise ValueError(f"no record of {old!r} to rename")
    return renamed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="samples.jsonl[.gz]")
    parser.add_argument("target", type=Path, help="the renamed samples.jsonl (written)")
    parser.add_argument("--from", dest="old", required=True, help="the controller spec the records name")
    parser.add_argument("--to", dest="new", required=True, help="the spec of the same file under its new path")
    args = parser.parse_args()
    records = relabel(unique_records(args.source), args.old, args.new)
    args.target.parent.mkdir(parents=True, exist_ok=True)
    args.target.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{args.target}: {len(records)} records, {sum(r['controller'] == args.new for r in records)} renamed")


if __name__ == "__main__":
    main()
