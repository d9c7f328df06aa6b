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
