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
    assert "| tova | 1 | tova | 2 | 0.500 | 0.000 | +0.500 |" in markdown(list(rows.values()))


def test_compare_pairs_by_ratio_and_protocol(tmp_path):
    """A kvgym budget pairs with kvpress's ratio 1 - budget in the same protocol, never with another ratio, another
    protocol or a KVzip variant the caller did not name; ``pairs`` names a variant explicitly."""
    peer_rows = []
    for index in range(4):
        for press, ratio, protocol, correct in [("kvzip", 0.75, "oneshot-question", True),
                                                ("kvzip", 0.875, "oneshot-question", False),
                                                ("kvzip", 0.75, "oneshot", False),
                                                ("kvzip_layerwise_shared", 0.75, "oneshot-question", index < 2)]:
            peer_rows.append({"press": press, "ratio": ratio, "protocol": protocol, "index": index, "task": "t",
                              "correct": correct, "answer": "x"})
    peer = write(tmp_path / "peer.jsonl", peer_rows)
    samples = write(tmp_path / "samples.jsonl", [
        {"controller": spec, "budget": budget, "protocol": "oneshot-question", "index": index, "score": score}
        for index in range(4)
        for spec, budget, score in [("kvzip", 0.25, 1.0), ("kvzip", 0.125, 0.0), ("kvzip:n_sink=8", 0.25, 0.0)]])
    rows = {(row["controller"], row["budget"]): row for row in compare(samples, peer)}
    assert rows["kvzip", 0.25]["kvpress"] == 1.0 and rows["kvzip", 0.25]["difference"] == 0.0  # not the 0.875 rows
    assert rows["kvzip", 0.125]["kvpress"] == 0.0 and rows["kvzip", 0.125]["same_correctness"] == 4
    low, high = rows["kvzip:n_sink=8", 0.25]["ci_low"], rows["kvzip:n_sink=8", 0.25]["ci_high"]
    assert rows["kvzip:n_sink=8", 0.25]["difference"] == -1.0 and low == high == -1.0
    paired = {(row["controller"], row["budget"]): row
              for row in compare(samples, peer, pairs={"kvzip:n_sink=8": "kvzip_layerwise_shared"})}
    assert paired["kvzip:n_sink=8", 0.25]["press"] == "kvzip_layerwise_shared"
    assert paired["kvzip:n_sink=8", 0.25]["kvpress"] == 0.5 and paired["kvzip", 0.25]["press"] == "kvzip"


def test_compressed_records_read_as_they_are(tmp_path):
    """Committed records are gzip-compressed: a reader given ``samples.jsonl`` finds ``samples.jsonl.gz``."""
    import gzip

    from eval.report import read_jsonl, records_file

    rows = [{"controller": "full", "index": 0, "score": 1.0}, {"controller": "tova", "index": 0, "score": 0.0}]
    (tmp_path / "samples.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    assert records_file(tmp_path / "samples.jsonl") == tmp_path / "samples.jsonl.gz"
    assert read_jsonl(tmp_path / "samples.jsonl", ("controller", "score")) == rows
    write(tmp_path / "samples.jsonl", rows[:1])  # both there: the plain file is the one a run appends to
    assert records_file(tmp_path / "samples.jsonl") == tmp_path / "samples.jsonl"
