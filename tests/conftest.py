"""Shared fixtures. The environment variables must be set before any Hugging Face import."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


def make_tiny_llama(vocab_size: int = 256, seed: int = 0):
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads), wired for paged attention."""
    from cache.models import tiny_random_llama

    return tiny_random_llama(vocab_size, seed)


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (converted on first use; `kvgym setup` does it ahead of time)."""
    from cache.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def alice_text() -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "eval" / "data" / "alice29.txt").read_text()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer Llama saved with SmolLM2's tokenizer files: a real folder model that loads in seconds."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cache.models import ensure_smollm2

    folder = tmp_path_factory.mktemp("tiny-llama")
    source = ensure_smollm2()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
