"""eval.peer: kvgym's samples.jsonl paired with kvpress's per-press results on the same sample indexes."""

import json

from eval.peer import compare, markdown


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_compare_pairs_controllers_with_presses_by_sample(tmp_path):
    peer = write(tmp_path / "peer.jsonl", [
        {"press": "none", "index": 0, "task": "passkey", "correct": True, "answer": " 123. Remember"},
        {"press": "none", "index": 1, "task": "niah", "correct": False, "answer": " 999"},
        {"press": "tova", "index": 0, "task": "passkey", "correct": False, "answer": " 7"},
        {"press": "tova", "index": 1, "task": "niah", "correct": False, "answer": " 8"},
    ])
    samples = write(tmp_path / "samples.jsonl", [
        {"controller": "full", "index": 0, "score": 1.0, "text": " 123. Remember it"},
        {"controller": "full", "index": 1, "score": 0.5, "text": " 12"},  # partial credit is not correct
        {"controller": "tova", "index": 0, "score": 1.0, "text": " 123"},
        {"controller": "tova", "index": 1, "score": 0.0, "text": " 8"},
        {"controller": "lru", "index": 0, "score": 1.0, "text": " 123"},  # no kvpress counterpart: left out
    ])
    rows = {row["controller"]: row for row in compare(samples, peer)}
    assert set(rows) == {"full", "tova"}
    assert rows["full"]["kvgym"] == rows["full"]["kvpress"] == 0.5 and rows["full"]["same_correctness"] == 2
    assert rows["full"]["same_answer_start"] == 1
    assert rows["tova"]["difference"] == 0.5 and rows["tova"]["same_correctness"] == 1
    assert rows["tova"]["per_task"]["passkey"] == {"kvgym": 1.0, "kvpress": 0.0, "n": 1}
    assert "| tova | tova | 2 | 0.500 | 0.000 | +0.500 | 1/2 |" in markdown(list(rows.values()))
