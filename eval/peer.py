"""Agreement with NVIDIA kvpress on the same samples: kvgym's ``samples.jsonl`` beside kvpress's per-press results.

``shared/peer/kvpress_2k_results.jsonl`` holds one line per (press, sample index): ``press``, ``index`` (the
line of the tasks file), ``task``, ``correct``, ``answer``. ``compare(samples, peer)`` pairs each kvgym
controller with the kvpress press of the same method (``PRESS_OF``) on the same sample indexes and reports
both accuracies, their difference, how often the two agree on a sample's correctness, and (for the full
cache) how many answers start the same. ``kvgym peer --samples S --peer P`` prints the table.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from eval.report import read_jsonl

# kvgym controller name -> kvpress press name in the peer file
PRESS_OF = {"full": "none", "streamingllm": "streamingllm", "tova": "tova", "snapkv": "snapkv", "knorm": "knorm",
            "keydiff": "keydiff", "expected_attention": "expected", "observed_attention": "observed",
            "pyramidkv": "pyramidkv", "kvzip": "kvzip"}


def compare(samples: str | Path, peer: str | Path, answer_chars: int = 10) -> list[dict]:
    """One row per kvgym controller spec with a kvpress counterpart (see the module docstring)."""
    peer_rows = {(row["press"], int(row["index"])): row for row in read_jsonl(peer)}
    by_spec: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
    for record in read_jsonl(samples):
        press = PRESS_OF.get(str(record["controller"]).split(":")[0])
        match = peer_rows.get((press, int(record["index"])))
        if match is not None:
            by_spec[record["controller"]].append((record, match))
    rows = []
    for spec, pairs in by_spec.items():
        n = len(pairs)
        ours = [record["score"] >= 1.0 for record, _ in pairs]
        theirs = [bool(match["correct"]) for _, match in pairs]
        tasks = defaultdict(lambda: [0, 0, 0])
        for (_, match), mine in zip(pairs, ours, strict=True):
            counts = tasks[match["task"]]
            counts[0] += mine
            counts[1] += bool(match["correct"])
            counts[2] += 1
        same_start = sum((record.get("text") or "").strip()[:answer_chars] == match["answer"].strip()[:answer_chars]
                         for record, match in pairs)
        rows.append({"controller": spec, "press": PRESS_OF[spec.split(":")[0]], "n": n,
                     "kvgym": sum(ours) / n, "kvpress": sum(theirs) / n, "difference": (sum(ours) - sum(theirs)) / n,
                     "same_correctness": sum(a == b for a, b in zip(ours, theirs, strict=True)),
                     "same_answer_start": same_start,
                     "per_task": {task: {"kvgym": c[0] / c[2], "kvpress": c[1] / c[2], "n": c[2]}
                                  for task, c in tasks.items()}})
    return rows


def markdown(rows: list[dict]) -> str:
    """The comparison as a Markdown table."""
    tasks = sorted({task for row in rows for task in row["per_task"]})
    header = ["kvgym", "kvpress press", "n", "kvgym acc", "kvpress acc", "diff", "same correctness"] + [
        f"{task} (kvgym / kvpress)" for task in tasks]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["controller"], row["press"], str(row["n"]), f"{row['kvgym']:.3f}", f"{row['kvpress']:.3f}",
                 f"{row['difference']:+.3f}", f"{row['same_correctness']}/{row['n']}"]
        cells += [f"{row['per_task'][t]['kvgym']:.1f} / {row['per_task'][t]['kvpress']:.1f}" if t in row["per_task"]
                  else "" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
