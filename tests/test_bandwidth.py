"""The instrumented bandwidth run (eval/bandwidth.py, `kvgym bench bandwidth`) on the tiny random Llama."""

import csv
import json
from types import SimpleNamespace

import pytest
import torch

from eval.bandwidth import CSV_COLUMNS, corpus_token_ids, run_bandwidth
from kvgym.cli import main

MAX_TOKENS, CHUNK, BUDGET = 256, 32, 0.25
BUDGET_BLOCKS = 4  # ceil(0.25 * 256 / 16)
BYTES_PER_TOKEN = 2 * 2 * 16 * 4  # K + V, 2 KV heads, head_dim 16, fp32


def random_ids(length, seed=3):
    return torch.randint(2, 256, (length,), generator=torch.Generator().manual_seed(seed))


def read_rows(out):
    with open(out / "bandwidth.csv", newline="") as f:
        return list(csv.DictReader(f))


class ByteTokenizer:
    """Text -> UTF-8 bytes as token ids (fits the tiny model's 256-token vocabulary)."""

    def __call__(self, text, **kwargs):
        return SimpleNamespace(input_ids=list(text.encode()))


@pytest.fixture(scope="module")
def bandwidth_run(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bandwidth")
    summary = run_bandwidth(tiny_model, out_dir=out, token_ids=random_ids(400), max_tokens=MAX_TOKENS,
                            budget=BUDGET, chunk=CHUNK, model_name="tiny", progress=False)
    return out, summary


def test_the_four_files_are_written(bandwidth_run):
    out, summary = bandwidth_run
    for name in ("bandwidth.csv", "bandwidth.png", "evictions.jsonl", "summary.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "bandwidth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["model"] == "tiny" and summary["max_tokens"] == MAX_TOKENS and summary["chunk"] == CHUNK
    assert summary["full"]["wall_s"] > 0 and summary["budgeted"]["wall_s"] > 0


def test_csv_has_one_row_per_step_and_run(bandwidth_run):
    rows = read_rows(bandwidth_run[0])
    steps = MAX_TOKENS // CHUNK
    assert len(rows) == 2 * steps
    assert tuple(rows[0]) == CSV_COLUMNS
    for run in ("full", "budgeted"):
        mine = [r for r in rows if r["run"] == run]
        assert [int(r["step"]) for r in mine] == list(range(steps))
        assert [int(r["context_tokens"]) for r in mine] == [CHUNK * (s + 1) for s in range(steps)]


def test_full_run_reads_bytes_linear_in_context(bandwidth_run):
    out, _ = bandwidth_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["full"]["r2"] >= 0.999
    assert summary["full"]["slope_bytes_per_token"] == pytest.approx(BYTES_PER_TOKEN)
    assert summary["bytes_per_token_per_layer"] == BYTES_PER_TOKEN
    for row in read_rows(out):
        if row["run"] == "full":  # every call reads the whole context
            assert int(row["resident_tokens"]) == int(row["context_tokens"])
            assert float(row["bytes_read_per_call"]) == int(row["context_tokens"]) * BYTES_PER_TOKEN


def test_budgeted_run_is_flat_and_stays_within_budget(bandwidth_run):
    out, _ = bandwidth_run
    summary = json.loads((out / "summary.json").read_text())
    budgeted = summary["budgeted"]
    assert budgeted["budget_blocks_per_layer"] == BUDGET_BLOCKS
    assert budgeted["flat_ratio"] <= 1.05
    assert budgeted["fallbacks"] == 0  # EvictOldest kept the budget by itself
    budget_tokens = BUDGET_BLOCKS * 16
    rows = [r for r in read_rows(out) if r["run"] == "budgeted"]
    assert max(int(r["resident_tokens"]) for r in rows) <= budget_tokens + CHUNK
    assert max(int(r["resident_after_budget"]) for r in rows) <= budget_tokens
    # once the budget is reached, each call reads budget + chunk tokens, far below the full run's last call
    assert float(rows[-1]["bytes_read_per_call"]) == (budget_tokens + CHUNK) * BYTES_PER_TOKEN
    assert budgeted["final_bytes_read_per_call"] < summary["full"]["final_bytes_read_per_call"] / 2


def test_evictions_jsonl_has_one_line_per_operation(bandwidth_run):
    out, summary = bandwidth_run
    lines = [json.loads(line) for line in (out / "evictions.jsonl").read_text().splitlines()]
    rows = read_rows(out)
    assert len(lines) == summary["budgeted"]["operations"] == int(rows[-1]["operations"]) > 0
    assert all(line["run"] == "budgeted" and line["op"] == "evict" and line["block"] != 0 for line in lines)
    # (MAX_TOKENS / 16 - BUDGET_BLOCKS) blocks leave each of the 2 layers
    assert len(lines) == 2 * (MAX_TOKENS // 16 - BUDGET_BLOCKS)


def test_text_corpus_with_a_host_tier_and_an_unaligned_chunk(tiny_model, tmp_path):
    corpus = tmp_path / "prose.txt"
    corpus.write_text("Alice was beginning to get very tired of sitting by her sister on the bank. " * 4)
    summary = run_bandwidth(tiny_model, ByteTokenizer(), out_dir=tmp_path / "out", corpus=corpus, max_tokens=130,
                            budget=3, chunk=24, host_blocks=3, progress=False)
    rows = [r for r in read_rows(tmp_path / "out") if r["run"] == "budgeted"]
    assert len(rows) == -(-130 // 24) and int(rows[-1]["context_tokens"]) == 130  # a short last step
    assert max(int(r["resident_tokens"]) for r in rows) <= 3 * 16 + 24
    moved = [int(r["bytes_moved"]) for r in rows]
    assert moved == sorted(moved) and moved[-1] == 2 * 3 * 16 * BYTES_PER_TOKEN  # the host tiers filled up
    assert summary["budgeted"]["bytes_moved"] == {"device->host": moved[-1]}
    tiers = [json.loads(line)["to"] for line in (tmp_path / "out" / "evictions.jsonl").read_text().splitlines()]
    assert tiers.count("host") == 2 * 3 and "dropped" in tiers


def test_json_token_id_corpus(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps([5, 6, 7]))
    assert corpus_token_ids(path) == [5, 6, 7]
    path.write_text(json.dumps({"ids": [1]}))
    with pytest.raises(ValueError, match="list of integer token ids"):
        corpus_token_ids(path)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 1100}, "exceeds the model's 1024 positions; use at most 1024"),
    ({"max_tokens": 300, "token_ids": list(range(2, 202))}, r"exceeds the corpus \(token_ids: 200 tokens\); use at most 200"),
    ({"chunk": 0}, "chunk: tokens per forward step must be an integer >= 1, got 0"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"token_ids": None, "corpus": "/nonexistent/corpus.txt"}, "'/nonexistent/corpus.txt' does not exist"),
    ({"token_ids": None, "corpus": None}, "needs a tokenizer"),
    ({"token_ids": [3, 999, 4] * 50}, r"token ids must be in 0\.\.255"),
    ({"budget": None}, "compares the full cache with a budgeted one"),
    ({"budget": 1}, "below the 2 pinned blocks"),
])
def test_bad_inputs_are_refused_before_any_work(tiny_model, tmp_path, kwargs, message):
    calls = []
    handle = tiny_model.register_forward_pre_hook(lambda *a: calls.append(1))
    arguments = {"out_dir": tmp_path / "out", "token_ids": random_ids(1200), "max_tokens": 128, "budget": BUDGET,
                 "chunk": CHUNK, "progress": False, **kwargs}
    try:
        with pytest.raises(ValueError, match=message):
            run_bandwidth(tiny_model, **arguments)
    finally:
        handle.remove()
    assert calls == []
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tiny_byte_checkpoint(tmp_path_factory):
    """The tiny random Llama saved with a byte-level tokenizer (ids 0..255), loadable by `--model FOLDER`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import make_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-byte-llama")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    make_tiny_llama().save_pretrained(folder)
    return folder


def test_cli_bandwidth_on_the_packaged_corpus(tiny_byte_checkpoint, tmp_path, capsys):
    out = tmp_path / "bw"
    code = main(["bench", "bandwidth", "--model", str(tiny_byte_checkpoint), "--max-tokens", "160", "--budget", "4",
                 "--chunk", "32", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "flat ratio" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["corpus"] == "alice29.txt" and summary["budgeted"]["budget_blocks_per_layer"] == 4
    assert summary["full"]["r2"] >= 0.999
    assert len(read_rows(out)) == 2 * 5


@pytest.mark.parametrize("arguments, message", [
    (["--corpus", "/nonexistent/corpus.txt"], "does not exist"),
    (["--chunk", "0"], "--chunk 0"),
    (["--max-tokens", "5000"], "exceeds the model's 1024 positions"),
])
def test_cli_bandwidth_bad_inputs_exit_2(tiny_byte_checkpoint, tmp_path, capsys, arguments, message):
    code = main(["bench", "bandwidth", "--model", str(tiny_byte_checkpoint), "--out", str(tmp_path / "bw"), *arguments])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgym bench bandwidth: error:") and message in err
