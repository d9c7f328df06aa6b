"""Tables and plots of an evaluation: ``summary.csv``, ``summary.md``, ``accuracy_vs_budget.png``, ``bytes_vs_context.png``.

One summary row per (controller, budget, task, length) over the samples run: ``n``, ``accuracy`` (mean
score) with its Wilson 95% interval (``ci_low``, ``ci_high``; scores in between 0 and 1, such as partial
``string_match_all`` credit, count as that fraction of a success), ``turn_accuracy`` (multi-turn samples: the
mean score of each turn, "t1/t2/..."), ``rel_accuracy`` (accuracy / the full cache's accuracy on the same samples; empty when the full
cache scores 0, and then ``full_cache_failed`` is 1), and the means of ``kl``, ``bytes_read_per_token``,
``bytes_moved_per_token``, ``decode_ms_per_token`` and ``ttft_ms``. The full cache has one row per task and
length, with budget 1.0. ``summary.md`` holds the same table, flags the groups where the full cache fails,
and adds the mean over tasks of ``rel_accuracy`` per controller and budget, which leaves those groups out
(and says so) rather than averaging them in, and a table pooled over tasks on the samples every controller
of a budget ran (``pooled_common``: a grid cut part-way still compares like with like).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import warnings
from collections import defaultdict
from pathlib import Path

from eval.records import record_key

SUMMARY_COLUMNS = ("controller", "budget", "task", "length", "n", "accuracy", "ci_low", "ci_high", "rel_accuracy",
                   "turn_accuracy", "kl", "bytes_read_per_token", "bytes_moved_per_token", "decode_ms_per_token",
                   "ttft_ms", "full_cache_failed")
MEAN_FIELDS = ("kl", "bytes_read_per_token", "bytes_moved_per_token", "decode_ms_per_token", "ttft_ms")
FULL = "full"
SAMPLE_FIELDS = ("controller", "budget", "task", "length", "index", "seed", "score")  # what a summary reads
COMPARE_FIELDS = ("controller", "budget", "task", "length", "score")  # compare pairs by task, length and sample


def _mean(values) -> float:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else math.nan


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default); (nan, nan) for n = 0."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _turn_accuracy(group: list[dict]) -> str:
    turns = [r.get("turn_scores") for r in group]
    if not turns or any(not t for t in turns):
        return ""
    count = min(len(t) for t in turns)
    return "/".join(f"{_mean(t[i] for t in turns):.2f}" for i in range(count))


def summarize(records: list[dict]) -> list[dict]:
    """Summary rows (numbers, not strings), ordered by task, length, controller (first seen), budget."""
    order = {"task": {}, "controller": {}}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    full_scores: dict[tuple, float] = {}
    for record in records:
        for field in order:
            order[field].setdefault(record[field], len(order[field]))
        groups[(record["controller"], float(record["budget"]), record["task"], int(record["length"]))].append(record)
        if record["controller"] == FULL:
            full_scores[(record["task"], int(record["length"]), int(record["index"]))] = float(record["score"])
    rows = []
    for (controller, budget, task, length), group in groups.items():
        accuracy = _mean(r["score"] for r in group)
        reference = [full_scores.get((task, length, int(r["index"]))) for r in group]
        full_accuracy = _mean(reference) if all(v is not None for v in reference) else math.nan
        failed = not math.isnan(full_accuracy) and full_accuracy == 0.0
        rel = accuracy / full_accuracy if not math.isnan(full_accuracy) and full_accuracy > 0 else math.nan
        ci_low, ci_high = wilson_interval(sum(float(r["score"]) for r in group), len(group))
        row = {"controller": controller, "budget": budget, "task": task, "length": length, "n": len(group),
               "accuracy": accuracy, "ci_low": ci_low, "ci_high": ci_high, "rel_accuracy": rel,
               "turn_accuracy": _turn_accuracy(group), "full_cache_failed": int(failed),
               "full_accuracy": full_accuracy, "metric": group[0].get("metric"),
               "perplexity": _mean(r.get("perplexity") for r in group)}
        row.update({field: _mean(r.get(field) for r in group) for field in MEAN_FIELDS})
        rows.append(row)
    rows.sort(key=lambda r: (order["task"][r["task"]], r["length"], order["controller"][r["controller"]], r["budget"]))
    return rows


def _format(column: str, value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        if column in ("accuracy", "rel_accuracy", "ci_low", "ci_high"):
            return f"{value:.4f}"
        if column == "kl":
            return f"{value:.6g}"
        if column == "budget":
            return f"{value:g}"
        if column.startswith("bytes"):
            return f"{value:.1f}"
        return f"{value:.3f}"
    return str(value)


def write_summary_csv(rows: list[dict], path: Path) -> None:
    """Write the summary rows as CSV."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(SUMMARY_COLUMNS)
        for row in rows:
            writer.writerow([_format(column, row[column]) for column in SUMMARY_COLUMNS])


def records_file(path: str | Path) -> Path:
    """``path``, or its gzip-compressed twin ``path.gz`` when only that exists (committed records are compressed)."""
    path = Path(path)
    compressed = path.with_name(path.name + ".gz")
    return compressed if not path.exists() and compressed.is_file() else path


def read_jsonl(path: str | Path, needed: tuple[str, ...] = ()) -> list[dict]:
    """The records of a JSON-lines file (``samples.jsonl``, kvpress's results; ``.gz``-compressed or not, see
    ``records_file``), blank lines skipped; a line that is not a JSON object (with the ``needed`` fields) is an
    error naming the file and the line. A truncated last line (an interrupted write: no final newline) is skipped
    with a warning, as ``kvgym eval`` does on resume."""
    path = records_file(path)
    text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text("utf-8")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not text.endswith("\n"):
                warnings.warn(f"{path}: skipping the truncated last line {number} (an interrupted write)", stacklevel=2)
                break
            raise ValueError(f"{path} line {number}: not JSON ({error.msg}); fix or remove the line") from None
        missing = [field for field in needed if not isinstance(record, dict) or field not in record]
        if not isinstance(record, dict) or missing:
            raise ValueError(f"{path} line {number}: not a record with {', '.join(needed) or 'fields'} "
                             f"(got {line[:60]!r}); fix or remove the line")
        records.append(record)
    return records


def _sample_key(record: dict) -> tuple:
    """What makes two records the same sample: task, length and the sample's hash (its index in old records)."""
    return record["task"], int(record["length"]), record.get("sample_hash") or record["index"]


def bootstrap_interval(diffs: list[float], boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean of paired ``diffs`` (``boot`` resamples, seeded)."""
    import random

    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(boot))
    return means[int(0.025 * boot)], means[min(int(0.975 * boot), boot - 1)]


def paired_differences(records: list[dict], controller: str, boot: int = 4000, seed: int = 0) -> list[dict]:
    """``controller`` against every other controller at each budget, on the samples both ran (matched by
    task, length and sample hash; pooled over tasks and lengths): mean score difference, its paired-bootstrap
    95% interval (``bootstrap_interval``), and the samples won, tied and lost."""
    scores: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for record in records:
        scores[(record["controller"], float(record["budget"]))][_sample_key(record)] = float(record["score"])
    mine = {budget: got for (name, budget), got in scores.items() if name == controller}
    if not mine:
        known = sorted({name for name, _ in scores})
        raise ValueError(f"controller {controller!r} is not in these results; they hold: {', '.join(known)}")
    rows = []
    for (other, budget), theirs in scores.items():
        if other == controller or budget not in mine:
            continue
        common = sorted(set(mine[budget]) & set(theirs), key=str)
        if not common:
            continue
        diffs = [mine[budget][s] - theirs[s] for s in common]
        ci_low, ci_high = bootstrap_interval(diffs, boot, seed)
        rows.append({"controller": controller, "other": other, "budget": budget, "n": len(diffs),
                     "mean": sum(mine[budget][s] for s in common) / len(common),
                     "other_mean": sum(theirs[s] for s in common) / len(common),
                     "difference": sum(diffs) / len(diffs), "ci_low": ci_low, "ci_high": ci_high, "wins": sum(d > 0 for d in diffs),
                     "ties": sum(d == 0 for d in diffs), "losses": sum(d < 0 for d in diffs)})
    return sorted(rows, key=lambda row: row["budget"])


def pooled_common(records: list[dict]) -> list[dict]:
    """Per budget, every controller's accuracy pooled over tasks and lengths on the samples that **all** the
    budget's controllers (and the full cache, where it ran) ran, so that the rows compare like with like when a
    grid was cut part-way: ``n`` samples, accuracy with its Wilson 95% interval, ``rel_accuracy`` (over the full
    cache's accuracy on the same samples) and the mean bytes moved between tiers per generated token. The full
    cache's row is listed first at each budget (with that budget)."""
    by_key: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for record in records:
        by_key[(record["controller"], float(record["budget"]))][_sample_key(record)] = record
    full = next((got for (name, _), got in by_key.items() if name == FULL), None)
    rows = []
    for budget in sorted({b for name, b in by_key if name != FULL}):
        names = [name for name, b in by_key if b == budget and name != FULL]
        common = set.intersection(*(set(by_key[(name, budget)]) for name in names))
        if full is not None:
            common &= set(full)
        if not common:
            continue
        full_accuracy = _mean(full[s]["score"] for s in common) if full is not None else math.nan
        for name in ([FULL] if full is not None else []) + names:
            got = [(full if name == FULL else by_key[(name, budget)])[s] for s in sorted(common, key=str)]
            accuracy = _mean(r["score"] for r in got)
            ci_low, ci_high = wilson_interval(sum(float(r["score"]) for r in got), len(got))
            rows.append({"controller": name, "budget": budget, "n": len(got), "accuracy": accuracy,
                         "ci_low": ci_low, "ci_high": ci_high,
                         "rel_accuracy": accuracy / full_accuracy if full_accuracy > 0 else math.nan,
                         "bytes_moved_per_token": _mean(r.get("bytes_moved_per_token") for r in got)})
    return rows


def pooled_common_md(rows: list[dict]) -> str:
    """The pooled rows as a Markdown table."""
    header = ["budget", "controller", "n", "accuracy", "95% CI", "rel_accuracy", "MB moved / token"]
    return _md_table(header, [[_format("budget", r["budget"]), r["controller"], str(r["n"]),
                               _format("accuracy", r["accuracy"]),
                               f"{_format('ci_low', r['ci_low'])} .. {_format('ci_high', r['ci_high'])}",
                               _format("rel_accuracy", r["rel_accuracy"]), f"{r['bytes_moved_per_token'] / 1e6:.1f}"]
                              for r in rows])


def paired_differences_md(rows: list[dict]) -> str:
    """The paired differences as a Markdown table."""
    header = ["budget", "vs", "n", "accuracy", "theirs", "difference", "95% CI", "won / tied / lost"]
    return _md_table(header, [[_format("budget", r["budget"]), r["other"], str(r["n"]), f"{r['mean']:.3f}",
                               f"{r['other_mean']:.3f}", f"{r['difference']:+.3f}",
                               f"{r['ci_low']:+.3f} .. {r['ci_high']:+.3f}", f"{r['wins']} / {r['ties']} / {r['losses']}"]
                              for r in rows])


def _md_table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def write_summary_md(rows: list[dict], path: Path, pooled: list[dict] | None = None) -> None:
    """Write the summary rows (and the pooled table) as Markdown, flagging cells where the full cache fails."""
    failed = sorted({(r["task"], r["length"]) for r in rows if r["full_cache_failed"]})
    header = list(SUMMARY_COLUMNS[:-1]) + ["flag"]
    lines = [[_format(c, row[c]) for c in SUMMARY_COLUMNS[:-1]]
             + ["⚠ full cache fails" if row["full_cache_failed"] else ""] for row in rows]
    parts = ["# kvgym eval summary", "",
             "accuracy: mean score (natural-text tasks, metric kl: top-1 next-token accuracy over the "
             "teacher-forced continuation), ci_low..ci_high its Wilson 95% interval; turn_accuracy: per turn "
             "(multi-turn tasks); rel_accuracy: accuracy / the full cache's accuracy on the same "
             "samples; kl: KL(full || controller) in nats at the first generated position (natural text: mean "
             "over the continuation); bytes per generated token; the full cache is listed with budget 1.", "",
             _md_table(header, lines), ""]
    if failed:
        listed = ", ".join(f"{task} @ {length}" for task, length in failed)
        parts += [f"**The full cache itself scores 0 on: {listed}.** rel_accuracy is undefined there (left "
                  "empty) and those groups are left out of the means below.", ""]
    means: dict[tuple, list[float]] = defaultdict(list)
    accuracies: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        if row["full_cache_failed"] or math.isnan(row["rel_accuracy"]):
            continue
        means[(row["controller"], row["budget"])].append(row["rel_accuracy"])
        accuracies[(row["controller"], row["budget"])].append(row["accuracy"])
    if means:
        groups = sorted({(r["task"], r["length"]) for r in rows} - set(failed))
        parts += [f"## Mean over {len(groups)} task × length group(s) where the full cache scores above 0", "",
                  _md_table(["controller", "budget", "groups", "mean accuracy", "mean rel_accuracy"],
                            [[c, _format("budget", b), str(len(v)), _format("accuracy", _mean(accuracies[(c, b)])),
                              _format("rel_accuracy", _mean(v))] for (c, b), v in means.items()]), ""]
    if pooled:
        parts += ["## Pooled over tasks, on the samples every controller of the budget ran", "",
                  "Wilson 95% intervals; rel_accuracy over the full cache on the same samples; bytes moved between "
                  "tiers per generated token. Only the samples common to all of a budget's controllers count, so "
                  "a cut grid still compares like with like.", "", pooled_common_md(pooled), ""]
    text_rows = [r for r in rows if r["metric"] == "kl"]
    if text_rows:
        parts += ["## Natural text: perplexity of the teacher-forced continuation", "",
                  _md_table(["controller", "budget", "task", "length", "perplexity", "kl"],
                            [[r["controller"], _format("budget", r["budget"]), r["task"], str(r["length"]),
                              _format("perplexity", r["perplexity"]), _format("kl", r["kl"])] for r in text_rows]), ""]
    path.write_text("\n".join(parts), encoding="utf-8")


def _figure(panels: int, width: float = 5.0, height: float = 3.8):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(3, max(panels, 1))
    nrows = -(-max(panels, 1) // cols)
    figure = Figure(figsize=(width * cols, height * nrows), dpi=110)
    FigureCanvasAgg(figure)
    axes = [figure.add_subplot(nrows, cols, i + 1) for i in range(max(panels, 1))]
    return figure, axes


def _weighted(rows: list[dict], field: str) -> float:
    pairs = [(r[field], r["n"]) for r in rows if not math.isnan(r[field])]
    total = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / total if total else math.nan


def plot_accuracy_vs_budget(rows: list[dict], path: Path) -> None:
    """One panel per task; accuracy (over all lengths, weighted by samples) vs budget, a line per controller,
    the full cache as a dashed horizontal line."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    controllers = list(dict.fromkeys(r["controller"] for r in rows if r["controller"] != FULL))
    figure, axes = _figure(len(tasks))
    colors = _colors(controllers)
    for ax, task in zip(axes, tasks, strict=False):
        task_rows = [r for r in rows if r["task"] == task]
        full_rows = [r for r in task_rows if r["controller"] == FULL]
        full_accuracy = _weighted(full_rows, "accuracy") if full_rows else math.nan
        for controller in controllers:
            budgets = sorted({r["budget"] for r in task_rows if r["controller"] == controller})
            values = [_weighted([r for r in task_rows if r["controller"] == controller and r["budget"] == b],
                                "accuracy") for b in budgets]
            ax.plot(budgets, values, _marker(controller, controllers) + "-", color=colors[controller], label=controller)
        if not math.isnan(full_accuracy):
            ax.axhline(full_accuracy, color="black", linestyle="--", linewidth=1, label="full cache")
        lengths = ",".join(str(x) for x in sorted({r["length"] for r in task_rows}))
        flag = "  [full cache fails]" if full_accuracy == 0.0 else ""
        ax.set_title(f"{task} (lengths {lengths}){flag}", color="tab:red" if flag else "black", fontsize=10)
        ax.set_xlabel("device budget (fraction of the context)")
        ax.set_ylabel("top-1 next-token accuracy" if task_rows[0]["metric"] == "kl" else "accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, alpha=0.3)
    _legend(axes[: len(tasks)], len(controllers) + 1)
    figure.tight_layout()
    figure.savefig(path, bbox_inches="tight")


def plot_bytes_vs_context(rows: list[dict], path: Path) -> None:
    """One panel per budget; attention bytes read per decoded token (mean over tasks, weighted by samples)
    vs context length, a line per controller, the full cache in every panel."""
    budgets = sorted({r["budget"] for r in rows if r["controller"] != FULL}) or [1.0]
    controllers = list(dict.fromkeys(r["controller"] for r in rows if r["controller"] != FULL))
    colors = _colors(controllers)
    figure, axes = _figure(len(budgets))
    mib = float(1 << 20)

    def line(ax, selected, label, style, color):
        lengths = sorted({r["length"] for r in selected})
        values = [_weighted([r for r in selected if r["length"] == x], "bytes_read_per_token") / mib for x in lengths]
        ax.plot(lengths, values, style, color=color, label=label)

    for ax, budget in zip(axes, budgets, strict=False):
        full_rows = [r for r in rows if r["controller"] == FULL]
        if full_rows:
            line(ax, full_rows, "full cache", "s--", "black")
        for controller in controllers:
            selected = [r for r in rows if r["controller"] == controller and r["budget"] == budget]
            if selected:
                line(ax, selected, controller, _marker(controller, controllers) + "-", colors[controller])
        ax.set_title(f"budget {budget:g}", fontsize=10)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("attention bytes read per token (MiB, all layers)")
        ax.grid(True, alpha=0.3)
    _legend(axes[: len(budgets)], len(controllers) + 1)
    figure.tight_layout()
    figure.savefig(path, bbox_inches="tight")


def _marker(name: str, names: list[str]) -> str:
    # 13 markers against 10 colours (coprime): no two of the first 130 controllers share colour and marker
    return "o^vD<>ph*XsPd"[names.index(name) % 13]  # overlapping lines stay distinguishable


def _legend(axes, count: int, many: int = 8) -> None:
    """A legend in each panel for a few lines; for ``many`` or more, one legend beside the last panel (a legend
    inside would cover the data)."""
    if count < many:
        for ax in axes:
            ax.legend(fontsize=7, loc="best")
        return
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _colors(names: list[str]) -> dict[str, str]:
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
               "tab:olive", "tab:cyan", "tab:gray"]
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def write_report(records: list[dict], out_dir: str | Path, plots: bool = True) -> list[dict]:
    """Write ``summary.csv``, ``summary.md`` and (with ``plots``) the two PNGs; returns the summary rows."""
    out = Path(out_dir)
    rows = summarize(records)
    write_summary_csv(rows, out / "summary.csv")
    write_summary_md(rows, out / "summary.md", pooled_common(records))
    if plots and rows:
        plot_accuracy_vs_budget(rows, out / "accuracy_vs_budget.png")
        plot_bytes_vs_context(rows, out / "bytes_vs_context.png")
    return rows


def unique_records(paths, needed: tuple[str, ...] = ()) -> list[dict]:
    """The records of one or more ``samples.jsonl`` files (``read_jsonl``), a run recorded twice (the same
    ``record_key``, e.g. by two commands into one folder) counting once: its last record."""
    paths = [paths] if isinstance(paths, (str, Path)) else paths
    return list({record_key(record): record for path in paths for record in read_jsonl(path, needed)}.values())


def report_folder(folder: Path, plots: bool = True) -> tuple[list[dict], list[dict]]:
    """Rewrite ``folder``'s summary (md, csv, plots) from every record of its ``samples.jsonl`` (several runs may
    have added to it; a record run twice counts once); returns the summary rows and the records."""
    samples = records_file(folder / "samples.jsonl")
    if not samples.is_file():
        raise ValueError(f"{folder}: no samples.jsonl in it; give a folder written by kvgym eval")
    records = unique_records(samples, SAMPLE_FIELDS)
    if not records:
        raise ValueError(f"{samples}: no records")
    return write_report(records, folder, plots=plots), records
