"""``kvgym report --leaderboard``: methods ranked per setting over the cells where the full cache is a ceiling."""

import json

import pytest

from eval.leaderboard import leaderboard, write_leaderboard
from kvgym.cli import main


def record(controller, budget, task, index, score, seed=7):
    return {"controller": controller, "budget": budget, "task": task, "length": 2048, "index": index, "seed": seed,
            "sample_hash": f"{task}{seed}{index}", "score": score}


def grid(seed=7):
    """Task ``easy``: the full cache answers 4/4; ``hard``: 1/4 (no ceiling at the 0.8 bar)."""
    rows = []
    for index in range(4):
        rows.append(record("full", 1.0, "easy", index, 1.0, seed))
        rows.append(record("full", 1.0, "hard", index, float(index == 0), seed))
        rows.append(record("good", 0.25, "easy", index, 1.0, seed))
        rows.append(record("good", 0.125, "easy", index, float(index < 2), seed))
        rows.append(record("weak", 0.25, "easy", index, float(index < 1), seed))
        rows.append(record("weak", 0.125, "easy", index, 0.0, seed))
        for name in ("good", "weak"):  # on the hard task the weak method happens to score higher
            rows.append(record(name, 0.25, "hard", index, float(name == "weak"), seed))
    return rows


def test_cells_without_a_ceiling_are_left_out_and_methods_ranked():
    board = leaderboard(grid())
    assert board["counted"] == [["easy", 2048]] and board["left_out"] == [["hard", 2048, 0.25]]
    assert board["ranking"] == ["good", "weak"] and board["full"] == 1.0
    assert board["methods"]["good"][4.0]["accuracy"] == 1.0 and board["methods"]["good"][8.0]["accuracy"] == 0.5
    assert board["methods"]["weak"][4.0] == {"accuracy": 0.25, "of_full": 0.25, "n": 4, "cells": 1}
    # negative control: with no bar the hard task counts and changes the figures
    loose = leaderboard(grid(), min_full=0.0)
    assert loose["methods"]["weak"][4.0]["accuracy"] == pytest.approx((1 + 4) / 8)
    assert loose["methods"]["weak"][4.0]["of_full"] == pytest.approx((5 / 8) / (5 / 8))


def test_two_seeds_are_matched_to_their_own_full_cache():
    other = [dict(r, score=1.0 - r["score"]) if r["controller"] == "full" and r["task"] == "hard" else r
             for r in grid(seed=8)]  # seed 8: the full cache answers 3/4 of hard
    board = leaderboard(grid() + other, min_full=0.0)
    hard_full = (1 + 3) / 8
    weak = board["methods"]["weak"][4.0]
    assert weak["n"] == 16 and weak["accuracy"] == pytest.approx((2 + 8) / 16)
    assert weak["of_full"] == pytest.approx(weak["accuracy"] / ((1.0 * 8 + hard_full * 8) / 16))


def _folder(path, protocol, records, chat=False):
    path.mkdir()
    (path / "eval_config.json").write_text(json.dumps({"protocol": protocol, "chat": chat, "host_blocks": 512}))
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_report_leaderboard_command_writes_one_board_per_setting(tmp_path, capsys):
    a = _folder(tmp_path / "a", "streaming", grid())
    b = _folder(tmp_path / "b", "streaming", grid()[:10])  # the same runs again: counted once
    c = _folder(tmp_path / "c", "oneshot-question", grid())
    out = tmp_path / "board"
    assert main(["report", str(a), str(b), str(c), "--leaderboard", str(out)]) == 0
    boards = json.loads((out / "leaderboard.json").read_text())
    assert sorted(boards) == ["oneshot-question, plain", "streaming, plain, host 512"]
    assert boards["streaming, plain, host 512"]["methods"]["good"]["4.0"]["n"] == 4
    assert (out / "leaderboard.png").stat().st_size > 0
    text = (out / "leaderboard.md").read_text()
    assert "| 1 | good | 1.000 | 0.500 |" in text and "hard @ 2048 (0.25)" in text
    assert main(["report", str(a), str(c)]) == 2 and "--leaderboard" in capsys.readouterr().err
    assert main(["report", str(a), "--leaderboard", str(out), "--min-full", "2"]) == 2
    with pytest.raises(ValueError, match="eval_config.json"):
        write_leaderboard([tmp_path], out)
