"""The benchmark scripts run end to end on the tiny model and report what they claim (no timing asserts)."""

from types import SimpleNamespace

import pytest
import torch

from cache.benchmark import bench_cache, bench_ops, bench_roofline, weight_bytes_per_token


class ByteTokenizer:
    """Maps text to ids 2..255 (one per character): enough to feed the tiny random model."""

    def __call__(self, text, return_tensors=None):
        ids = torch.tensor([2 + ord(c) % 254 for c in text])
        return SimpleNamespace(input_ids=ids[None] if return_tensors == "pt" else ids.tolist())


TEXT = "The grass is green. The sky is blue. " * 20


def test_bench_cache_reports_interleaved_medians_and_agreement(tiny_model):
    report = bench_cache(tiny_model, ByteTokenizer(), TEXT, [64, 128], decode_steps=4, prefill_repeats=2)
    rows = report["results"]
    assert [row["context"] for row in rows] == [64, 128]
    for row in rows:
        assert row["greedy_tokens_agree"] is True
        # the times are rounded to 0.01 ms and the ratio to 0.001: on a fast machine the tiny model's steps take a
        # fraction of a millisecond, so the rounding alone moves paged_ms / dynamic_ms by a few percent
        rounding = 0.005 / row["dynamic_ms"] * (1 + row["ratio"]) + 0.0005
        assert abs(row["ratio"] - row["paged_ms"] / row["dynamic_ms"]) < 0.01 * row["ratio"] + rounding


def test_bench_ops_reports_every_operation_and_decode_ratio(tiny_model):
    report = bench_ops(tiny_model, ByteTokenizer(), TEXT, [256], budget=0.25, decode_steps=3, op_context=256,
                       repeats=2)
    operations = report["operations"]
    for key in ("evict_to_host_ms", "prefetch_from_host_ms", "evict_to_disk_ms", "prefetch_from_disk_ms",
                "merge_ms", "decode_step_ms", "view_ms", "view_share_of_decode_step"):
        assert operations[key] >= 0, key
    assert operations["merge_one_call_per_layer_ms"] >= 0
    (decode,) = report["decode"]
    assert decode["context"] == 256 and decode["budget_blocks_per_layer"] == 4
    assert set(decode["mean_ms"]) == {"full", "budgeted", "budgeted_merge"} and decode["merge_ms"] >= 0
    assert abs(decode["merge_vs_evict_mean"] - decode["mean_ms"]["budgeted_merge"] / decode["mean_ms"]["budgeted"]) < 0.01


def test_weight_bytes_count_tied_weights_once_and_one_row_of_an_untied_embedding(tiny_model):
    params = sum(p.numel() * 4 for p in tiny_model.parameters())
    embedding = tiny_model.get_input_embeddings().weight
    tied = tiny_model.get_output_embeddings().weight is embedding
    expected = params if tied else params - (embedding.shape[0] - 1) * embedding.shape[1] * 4
    assert weight_bytes_per_token(tiny_model) == expected


def test_bench_roofline_reports_the_floor_from_weights_and_the_kv_actually_read(tiny_model):
    report = bench_roofline(tiny_model, ByteTokenizer(), TEXT, [128, 256], budget=0.25, decode_steps=3, bandwidth_mb=8)
    assert [b["context"] for b in report["bandwidth"]] == [128, 256]
    assert all(b["before"]["read_gbps"] > 0 and b["after"]["copy_gbps"] > 0 for b in report["bandwidth"])
    rows = {(row["context"], row["cache"]): row for row in report["rows"]}
    assert set(rows) == {(c, k) for c in (128, 256) for k in ("full", "budgeted")}
    kv_per_token = 2 * 2 * 16 * 4 * 2  # K+V, 2 KV heads, head_dim 16, fp32, 2 layers
    for (context, kind), row in rows.items():
        resident = context + 2 if kind == "full" else row["budget_blocks_per_layer"] * 16  # tokens attended
        assert abs(row["kv_bytes"] - resident * kv_per_token) <= 16 * kv_per_token
        assert row["floor_bytes"] == row["weight_bytes"] + row["kv_bytes"]
        expected_ms = 1000 * row["floor_bytes"] / (row["read_gbps"] * 1e9)
        assert abs(row["floor_ms"] - expected_ms) <= 0.01 + 0.01 * expected_ms
        assert row["roofline_fraction"] > 0
    assert rows[(256, "budgeted")]["kv_bytes"] < rows[(256, "full")]["kv_bytes"]
    for band in report["bandwidth"]:
        matvec = band["matvec_before"]
        assert matvec["linears"] == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the output head
        assert matvec["weight_bytes"] == sum(m.weight.numel() * 4 for m in tiny_model.modules()
                                             if isinstance(m, torch.nn.Linear))
        assert matvec["ms"] > 0 and matvec["gbps"] > 0
    for row in rows.values():
        assert row["matvec_fraction"] == pytest.approx(row["matvec_ms"] / row["ms_per_token"], rel=0.02, abs=0.01)


def test_relabel_renames_a_policy_s_records_only_to_the_file_they_read(tmp_path, monkeypatch):
    """``benchmarks.relabel_records``: a record moves to the new name when its digest is the new file's; a record
    of another file (negative control: the same name, other bytes) is refused, and other controllers pass as they are."""
    from benchmarks.relabel_records import relabel
    from eval.records import controller_digest

    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.pt").write_bytes(b"weights A")
    (tmp_path / "new.pt").write_bytes(b"weights A")
    (tmp_path / "other.pt").write_bytes(b"weights B")
    digest = controller_digest("ranker:old.pt")
    records = [{"controller": "ranker:old.pt,stay=2", "controller_digest": digest, "task": "t", "index": 0, "budget": 0.25},
               {"controller": "full", "task": "t", "index": 0, "budget": 1.0}]
    renamed = relabel(records, "ranker:old.pt,stay=2", "ranker:new.pt,stay=2")
    assert [r["controller"] for r in renamed] == ["ranker:new.pt,stay=2", "full"] and renamed[1] == records[1]
    with pytest.raises(ValueError, match="digest"):
        relabel(records, "ranker:old.pt,stay=2", "ranker:other.pt,stay=2")
    with pytest.raises(ValueError, match="no record"):
        relabel(records, "ranker:missing.pt", "ranker:new.pt")
