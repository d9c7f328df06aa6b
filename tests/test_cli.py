"""The `kvgym` command line on a tiny local checkpoint (a random 2-layer Llama with SmolLM2's tokenizer)."""

import json

import pytest

from kvgym.cli import main, parse_budget


def test_generate_prints_text_and_cache_state(tiny_checkpoint, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Alice was beginning to get very tired of sitting by her sister on the bank. " * 6)
    out_json = tmp_path / "run.json"
    code = main(["generate", "--model", str(tiny_checkpoint), "--prompt-file", str(prompt), "--budget", "4",
                 "--max-new-tokens", "12", "--no-chat", "--prefill-chunk", "16", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "cache state after the run" in printed and "device" in printed and "dropped" in printed
    assert "bytes read by attention per decoded token" in printed
    summary = json.loads(out_json.read_text())
    assert summary["budget_blocks_per_layer"] == 4
    assert summary["blocks_per_tier_all_layers"]["device"] <= 2 * 4
    assert summary["blocks_per_tier_all_layers"]["dropped"] > 0
    assert summary["bytes_read_per_token"] > 0


def test_generate_rejects_a_budget_below_the_pinned_blocks(tiny_checkpoint, capsys):
    code = main(["generate", "--model", str(tiny_checkpoint), "--prompt", "hello there " * 40, "--budget", "1",
                 "--no-chat", "--max-new-tokens", "2"])
    assert code == 2
    assert "pinned" in capsys.readouterr().err


def test_generate_rejects_a_prompt_longer_than_the_positions(tiny_checkpoint, capsys):
    code = main(["generate", "--model", str(tiny_checkpoint), "--prompt", "word " * 600, "--no-chat"])
    assert code == 2
    assert "exceeds the model's 512 positions" in capsys.readouterr().err


def test_unknown_model_lists_aliases(capsys):
    code = main(["generate", "--model", "gpt-17", "--prompt", "hi"])
    assert code == 2
    err = capsys.readouterr().err
    assert "smollm2-135m" in err and "tinyllama" in err


def test_budget_parsing():
    assert parse_budget("0.25") == 0.25
    assert parse_budget("64") == 64
    assert parse_budget("full") is None
    with pytest.raises(Exception, match="fraction like 0.25"):
        parse_budget("lots")


def test_generate_with_a_named_controller_and_tiers(tiny_checkpoint, tmp_path, capsys):
    out_json = tmp_path / "run.json"
    code = main(["generate", "--model", str(tiny_checkpoint), "--prompt", "The sky is blue. " * 30,
                 "--budget", "4", "--controller", "streamingllm:n_sink=20", "--host-blocks", "2",
                 "--disk-blocks", "2", "--max-new-tokens", "4", "--no-chat", "--json", str(out_json)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(out_json.read_text())
    tiers = summary["blocks_per_tier_all_layers"]
    assert tiers["host"] == 2 * 2 and tiers["disk"] == 2 * 2 and tiers["device"] <= 2 * 4
    assert summary["fallbacks"] == 0
    assert "streamingllm:n_sink=20" in capsys.readouterr().out


def test_generate_rejects_an_unknown_controller(capsys):
    assert main(["generate", "--controller", "h3o", "--prompt", "hi"]) == 2
    assert "unknown controller 'h3o'" in capsys.readouterr().err
