"""Agreement with NVIDIA kvpress on the same samples: kvgym's ``samples.jsonl`` beside kvpress's per-press results.

A kvpress results file (``shared/peer/kvpress_2k_results.jsonl``; ``benchmarks/kvpress_peer/run_kvpress.py``
writes more) holds one line per (press, ratio, protocol, sample index): ``press``, ``ratio`` (kvpress's compression
ratio: 0.75 = 25% kept; 0 for ``none``), ``protocol``, ``index`` (the line of the tasks file), ``task``, ``correct``,
``answer``. ``compare(samples, peer)`` pairs each kvgym run (controller spec, budget, protocol) with the kvpress
press of the same method (``PRESS_OF``, or ``pairs``: spec or name -> press) at ``ratio = 1 - budget`` in the same
protocol on the same sample indexes (a peer row without ``ratio`` or ``protocol`` matches any), and reports both
accuracies, their paired difference with its bootstrap 95% interval, how often the two agree on a sample's
correctness, and how many answers start the same. ``kvgym peer --samples S --peer P`` prints the table.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from eval.report import bootstrap_interval, read_jsonl

# kvgym controller name -> kvpress press name in the peer file
PRESS_OF = {"full": "none", "streamingllm": "streamingllm", "tova": "tova", "snapkv": "snapkv", "knorm": "knorm",
            "keydiff": "keydiff", "expected_attention": "expected", "observed_attention": "observed",
            "pyramidkv": "pyramidkv", "kvzip": "kvzip"}


def _matches(row: dict, press: str, ratio: float, protocol: str | None) -> bool:
    return (row["press"] == press and ("ratio" not in row or abs(float(row["ratio"]) - ratio) < 1e-6)
            and (protocol is None or "protocol" not in row or row["protocol"] == protocol))


def compare(samples: str | Path, peer: str | Path, pairs: dict[str, str] | None = None,
            answer_chars: int = 10) -> list[dict]:
    """One row per kvgym run (controller spec, budget, protocol) with a kvpress counterpart (module docstring)."""
    press_of = {**PRESS_OF, **(pairs or {})}
    peer_rows = defaultdict(list)
    for row in read_jsonl(peer, ("press", "index", "correct")):
        peer_rows[int(row["index"])].append(row)
    by_run: dict[tuple, list[tuple[dict, dict]]] = defaultdict(list)
    for record in read_jsonl(samples, ("controller", "index", "score")):
        spec = str(record["controller"])
        press = press_of.get(spec, press_of.get(spec.split(":")[0]))
        budget = float(record.get("budget", 1.0))
        ratio = 0.0 if spec == "full" else round(1.0 - budget, 6)
        match = next((row for row in peer_rows.get(int(record["index"]), [])
                      if _matches(row, press, ratio, record.get("protocol"))), None)
        if press is not None and match is not None:
            by_run[(spec, budget, record.get("protocol"), press)].append((record, match))
    rows = []
    for (spec, budget, protocol, press), found in by_run.items():
        n = len(found)
        ours = [record["score"] >= 1.0 for record, _ in found]
        theirs = [bool(match["correct"]) for _, match in found]
        ci_low, ci_high = bootstrap_interval([float(a) - float(b) for a, b in zip(ours, theirs, strict=True)])
        tasks = defaultdict(lambda: [0, 0, 0])
        for (_, match), mine in zip(found, ours, strict=True):
            counts = tasks[match.get("task", "")]
            counts[0] += mine
            counts[1] += bool(match["correct"])
            counts[2] += 1
        same_start = sum((record.get("text") or "").strip()[:answer_chars] == match["answer"].strip()[:answer_chars]
                         for record, match in found)
        rows.append({"controller": spec, "budget": budget, "protocol": protocol, "press": press, "n": n,
                     "kvgym": sum(ours) / n, "kvpress": sum(theirs) / n, "difference": (sum(ours) - sum(theirs)) / n,
                     "ci_low": ci_low, "ci_high": ci_high,
                     "same_correctness": sum(a == b for a, b in zip(ours, theirs, strict=True)),
                     "same_answer_start": same_start,
                     "per_task": {task: {"kvgym": c[0] / c[2], "kvpress": c[1] / c[2], "n": c[2]}
                                  for task, c in tasks.items()}})
    return sorted(rows, key=lambda row: (str(row["protocol"]), -row["budget"], row["controller"]))


def markdown(rows: list[dict]) -> str:
    """The comparison as a Markdown table."""
    tasks = sorted({task for row in rows for task in row["per_task"]})
    header = ["kvgym", "budget", "kvpress press", "n", "kvgym acc", "kvpress acc", "diff", "95% CI",
              "same correctness"] + [
        f"{task} (kvgym / kvpress)" for task in tasks]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["controller"], f"{row['budget']:g}", row["press"], str(row["n"]), f"{row['kvgym']:.3f}",
                 f"{row['kvpress']:.3f}", f"{row['difference']:+.3f}", f"{row['ci_low']:+.2f}..{row['ci_high']:+.2f}",
                 f"{row['same_correctness']}/{row['n']}"]
        cells += [f"{row['per_task'][t]['kvgym']:.1f} / {row['per_task'][t]['kvpress']:.1f}" if t in row["per_task"]
                  else "" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_pairs(items: list[str]) -> dict[str, str]:
    """``--pair SPEC=PRESS`` values → ``{spec: press}``; a value without both sides is an error naming it."""
    pairs = {}
    for item in items:
        spec, sep, press = item.rpartition("=")
        if not sep or not spec or not press:
            raise ValueError(f"--pair {item!r}: give SPEC=PRESS, e.g. kvzip=kvzip_layerwise_shared")
        pairs[spec] = press
    return pairs
