"""The README's headline table quotes the committed summary (issue 38: every figure the README quotes comes from a
committed summary): each cell is recomputed from `results/generalization/heldout_stream_2k_plain.json`."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICY = "ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,question_reread=true"


def _percent(value: float) -> str:
    return f"{round(100 * value)}%"


def headline_problems(readme: str, summary: list[dict]) -> list[str]:
    """Cells of the README's headline rows that differ from the summary (or rows missing)."""
    problems = []
    for cell in summary:
        row = next((line for line in readme.splitlines() if line.startswith(f"| {cell['budget']} | ")), None)
        if row is None:
            problems.append(f"no headline row for budget {cell['budget']}")
            continue
        cells = [text.strip().strip("*") for text in row.strip("|").split("|")]
        policy = cell[f"policy {POLICY}"]
        low, high = policy["minus_best_ci"]
        captured_low, captured_high = policy["captured_ci"]
        expected = {
            1: f"{cell['full']:.3f}",
            2: f"{cell['methods']['oracle:prefetch=true']:.3f}",
            4: f"{cell['methods'][POLICY]:.3f}",
            5: f"{policy['minus_best']:+.3f} ({low:+.2f}..{high:+.2f})",
            6: f"{_percent(policy['captured'])} ({_percent(captured_low)}..{_percent(captured_high)})",
            7: _percent(policy["of_full"]),
        }
        best = cell["best_heuristic"]
        if not cells[3].lower().replace(" ", "").startswith(f"{best}{cell['methods'][best]:.3f}"):
            problems.append(f"budget {cell['budget']}: best heuristic cell {cells[3]!r}, summary {best} "
                            f"{cell['methods'][best]:.3f}")
        problems += [f"budget {cell['budget']}, column {i}: README {cells[i]!r}, summary {want!r}"
                     for i, want in expected.items() if cells[i] != want]
    return problems


def test_the_headline_table_is_the_committed_summary():
    readme = (ROOT / "README.md").read_text()
    summary = json.loads((ROOT / "results/generalization/heldout_stream_2k_plain.json").read_text())
    assert len(summary) == 2
    assert headline_problems(readme, summary) == []
    # negative controls: a changed figure and a missing row are found
    assert headline_problems(readme.replace("**0.633**", "**0.600**"), summary)
    assert headline_problems(readme.replace("| 0.125 | 0.633", "| 0.12 | 0.633"), summary)
