"""The benchmark scripts run end to end on the tiny model and report what they claim (no timing asserts)."""

from types import SimpleNamespace

import torch

from cache.benchmark import bench_cache, bench_ops


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
        assert abs(row["ratio"] - row["paged_ms"] / row["dynamic_ms"]) < 0.01 * row["ratio"] + 0.002


def test_bench_ops_reports_every_operation_and_decode_ratio(tiny_model):
    report = bench_ops(tiny_model, ByteTokenizer(), TEXT, [256], budget=0.25, decode_steps=3, op_context=256,
                       repeats=2)
    operations = report["operations"]
    for key in ("evict_to_host_ms", "prefetch_from_host_ms", "evict_to_disk_ms", "prefetch_from_disk_ms",
                "merge_ms", "decode_step_ms", "view_ms", "view_share_of_decode_step"):
        assert operations[key] >= 0, key
    (decode,) = report["decode"]
    assert decode["context"] == 256 and decode["budget_blocks_per_layer"] == 4
