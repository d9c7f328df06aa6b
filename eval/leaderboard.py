"""A leaderboard over several ``kvgym eval`` folders: accuracy against compression, one plot per setting
(protocol, prompt form, host tier), and a ranked table, as kvpress's leaderboard shows its presses.

A **cell** is one task at one length in one setting. A cell counts only where the full cache scores at least
``min_full`` on its samples (below that, the full cache is no ceiling and compression cannot be told apart from
the task's own failure): such cells are listed as left out, never averaged in. A method's score at a compression
(1 / budget) is its mean accuracy over the counted cells it ran, weighted by samples; ``of_full`` divides it by
the full cache's accuracy on the same cells. Methods are ranked within a setting by their mean score over the
compressions they ran (methods that ran fewer compressions say so in the table).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from eval.report import FULL, _colors, _figure, _marker, _weighted, read_jsonl, records_file, summarize

RECORD_FIELDS = ("controller", "budget", "task", "length", "index", "seed", "score")


def setting_of(config: dict) -> str:
    """A folder's setting from its ``eval_config.json``: protocol, prompt form, and the host tier when streaming."""
    protocol = config.get("protocol", "oneshot")
    parts = [protocol, "chat" if config.get("chat", True) else "plain"]
    if protocol in ("streaming", "multiturn"):
        parts.append(f"host {config.get('host_blocks', 0) or 0}")
    return ", ".join(parts)


def read_folders(folders: list[str | Path]) -> dict[str, list[dict]]:
    """Every folder's records grouped by setting; a run recorded in several folders of one setting counts once."""
    from eval.records import record_key

    by_setting: dict[str, dict[tuple, dict]] = defaultdict(dict)
    for folder in map(Path, folders):
        config_path = folder / "eval_config.json"
        samples = records_file(folder / "samples.jsonl")
        if not config_path.is_file() or not samples.is_file():
            raise ValueError(f"{folder}: no eval_config.json and samples.jsonl there; give folders written by kvgym eval")
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{config_path}: not valid JSON") from None
        setting = setting_of(config)
        for record in read_jsonl(samples, RECORD_FIELDS):
            by_setting[setting][record_key(record)] = record
    return {setting: list(records.values()) for setting, records in by_setting.items()}


def leaderboard(records: list[dict], min_full: float = 0.8) -> dict:
    """One setting's leaderboard: ``methods`` (name → {compression: score, ...}), ``full`` (its accuracy on the
    counted cells), ``counted`` and ``left_out`` cells, and ``ranking`` (best first)."""
    rows = _summarize_over_seeds(records)
    full = {(r["task"], r["length"]): r for r in rows if r["controller"] == FULL}
    counted = sorted(cell for cell, row in full.items() if row["accuracy"] >= min_full)
    left_out = sorted((cell, full[cell]["accuracy"]) for cell in full if cell not in counted)
    cells: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for row in rows:
        if row["controller"] != FULL and (row["task"], row["length"]) in counted:
            cells[(row["controller"], row["budget"])].append(row)
    methods: dict[str, dict] = defaultdict(dict)
    for (controller, budget), group in cells.items():
        accuracy, full_accuracy = _weighted(group, "accuracy"), _weighted(group, "full_accuracy")
        methods[controller][round(1 / budget, 4)] = {
            "accuracy": accuracy, "of_full": accuracy / full_accuracy if full_accuracy > 0 else math.nan,
            "n": sum(r["n"] for r in group), "cells": len(group)}
    ranking = sorted(methods, key=lambda m: -_mean_score(methods[m]))
    return {"min_full": min_full, "counted": [list(c) for c in counted],
            "left_out": [[*c, accuracy] for c, accuracy in left_out],
            "full": _weighted([full[c] for c in counted], "accuracy"),
            "methods": {m: methods[m] for m in ranking}, "ranking": ranking}


def _summarize_over_seeds(records: list[dict]) -> list[dict]:
    """``summarize``'s rows per seed (it matches the full cache by sample index), pooled per (controller, budget,
    task, length), weighted by samples."""
    by_seed: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_seed[int(record["seed"])].append(record)
    pooled: dict[tuple, list[dict]] = defaultdict(list)
    for seed_records in by_seed.values():
        for row in summarize(seed_records):
            pooled[(row["controller"], row["budget"], row["task"], row["length"])].append(row)
    rows = []
    for (controller, budget, task, length), group in pooled.items():
        known = all(not math.isnan(r["full_accuracy"]) for r in group)  # a seed without its full cache: no ratio
        rows.append({"controller": controller, "budget": budget, "task": task, "length": length,
                     "n": sum(r["n"] for r in group), "accuracy": _weighted(group, "accuracy"),
                     "full_accuracy": _weighted(group, "full_accuracy") if known else math.nan})
    return rows


def _mean_score(by_compression: dict) -> float:
    return sum(v["accuracy"] for v in by_compression.values()) / len(by_compression)


def leaderboard_md(boards: dict[str, dict]) -> str:
    """The ranked tables, one per setting, with the cells counted and left out."""
    parts = ["# Leaderboard", ""]
    for setting, board in boards.items():
        compressions = sorted({c for m in board["methods"].values() for c in m})
        parts += [f"## {setting}", "",
                  f"Cells counted (full cache ≥ {board['min_full']:g}): "
                  + (", ".join(f"{t} @ {n}" for t, n in board["counted"]) or "none")
                  + f"; full cache {board['full']:.3f} on them."]
        if board["left_out"]:
            parts.append("Left out (full cache below the bar): "
                         + ", ".join(f"{t} @ {n} ({a:.2f})" for t, n, a in board["left_out"]) + ".")
        header = ["rank", "method", *[f"{c:g}×" for c in compressions], "mean", "of full", "n"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for rank, method in enumerate(board["ranking"], 1):
            scores = board["methods"][method]
            cells = [f"{scores[c]['accuracy']:.3f}" if c in scores else "–" for c in compressions]
            of_full = [v["of_full"] for v in scores.values() if not math.isnan(v["of_full"])]
            mean_of_full = f"{sum(of_full) / len(of_full):.0%}" if of_full else ""
            samples = "/".join(str(scores[c]["n"]) for c in compressions if c in scores)
            lines.append(f"| {rank} | {method} | " + " | ".join(cells)
                         + f" | {_mean_score(scores):.3f} | {mean_of_full} | {samples} |")
        parts += ["", *lines, ""]
    return "\n".join(parts)


def plot_leaderboard(boards: dict[str, dict], path: Path) -> None:
    """One panel per setting: accuracy against compression (log scale), a line per method, the full cache dashed."""
    settings = list(boards)
    figure, axes = _figure(len(settings))
    methods = list(dict.fromkeys(m for b in boards.values() for m in b["ranking"]))
    colors = _colors(methods)
    for ax, setting in zip(axes, settings, strict=False):
        board = boards[setting]
        for method in board["ranking"]:
            scores = board["methods"][method]
            compressions = sorted(scores)
            ax.plot(compressions, [scores[c]["accuracy"] for c in compressions], _marker(method, methods) + "-",
                    color=colors[method], label=method)
        if not math.isnan(board["full"]):
            ax.axhline(board["full"], color="black", linestyle="--", linewidth=1, label="full cache")
        ax.set_xscale("log", base=2)
        ticks = sorted({c for m in board["methods"].values() for c in m})
        ax.set_xticks(ticks, [f"{c:g}×" for c in ticks])
        ax.set_title(setting, fontsize=10)
        ax.set_xlabel("compression (context / device budget)")
        ax.set_ylabel("accuracy (cells with full cache ≥ bar)")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, alpha=0.3)
    labelled = {}  # one legend for every panel's methods (each panel shows only those of its setting)
    for ax in axes[: len(settings)]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    figure.tight_layout()
    figure.legend(labelled.values(), labelled.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 0.95))
    figure.savefig(path, bbox_inches="tight")


def write_leaderboard(folders: list[str | Path], out: str | Path, min_full: float = 0.8, plots: bool = True) -> dict:
    """Read ``folders``, write ``out/leaderboard.md``, ``leaderboard.json`` and (with ``plots``) ``leaderboard.png``."""
    if not 0 <= min_full <= 1:
        raise ValueError(f"--min-full {min_full}: expected the full cache's accuracy a cell needs, in 0..1")
    boards = {setting: leaderboard(records, min_full) for setting, records in read_folders(folders).items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaderboard.md").write_text(leaderboard_md(boards), encoding="utf-8")
    (out / "leaderboard.json").write_text(json.dumps(boards, indent=1, default=str), encoding="utf-8")
    if plots and boards:
        plot_leaderboard(boards, out / "leaderboard.png")
    return boards
