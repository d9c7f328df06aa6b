"""Controllers by name, with parameters from ``configs/controllers/<name>.yaml`` and command-line overrides.

A spec is ``name`` or ``name:key=value,key=value`` (values parsed as YAML: ``0.98``, ``true``, ``[1, 2]``); a
controller with a ``positional_parameter`` takes a bare first value for it (``ppo:policies/ppo_smollm2.zip``).
The same specs serve the CLI (``--controller h2o:recent_tokens=128``), the environment and the evaluation.
"""

from __future__ import annotations

import dataclasses
from importlib import import_module
from pathlib import Path

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "controllers"

# name -> "module:Class"; modules are imported on first use
CONTROLLERS: dict[str, str] = {
    "full": "agents.baselines.full_cache:FullCache",
    "fifo": "agents.baselines.streaming_llm:SlidingWindow",
    "streamingllm": "agents.baselines.streaming_llm:StreamingLLM",
    "lru": "agents.baselines.lru:LRU",
    "h2o": "agents.baselines.h2o:H2O",
    "snapkv": "agents.baselines.snapkv:SnapKV",
    "tova": "agents.baselines.tova:TOVA",
    "sentencekv": "agents.baselines.sentencekv:SentenceKV",
    "quest": "agents.baselines.quest:Quest",
    "spindlekv": "agents.baselines.spindlekv:SpindleKV",
    "oracle": "agents.baselines.oracle:Oracle",
    "ppo": "agents.ppo.controller:PPOController",
}


LEARNED = {"ppo"}  # controllers loaded from a trained file (the rest are the baselines)
BASELINES = sorted(set(CONTROLLERS) - LEARNED)

POSITIONAL = "<positional>"  # parse_spec's key for a bare first value


def register(name: str, target: str) -> None:
    """Add a controller class under ``name`` (``target`` = ``"module:Class"``)."""
    CONTROLLERS[name] = target


def controller_class(name: str):
    if name not in CONTROLLERS:
        raise ValueError(f"unknown controller {name!r}: choose from {', '.join(sorted(CONTROLLERS))}")
    module, _, cls = CONTROLLERS[name].partition(":")
    return getattr(import_module(module), cls)


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"h2o:recent_tokens=128,heavy=0.5"`` → ``("h2o", {"recent_tokens": 128, "heavy": 0.5})``."""
    name, _, rest = spec.strip().partition(":")
    overrides = {}
    for position, item in enumerate(filter(None, (part.strip() for part in rest.split(",")))):
        key, sep, value = item.partition("=")
        if not sep and position == 0:
            overrides[POSITIONAL] = item
            continue
        if not sep or not key.strip():
            raise ValueError(f"controller spec {spec!r}: expected key=value after ':', got {item!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    return name.strip().lower(), overrides


def config_defaults(name: str) -> dict:
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of parameter names to values")
    return data


def make_controller(spec: str):
    """Build a controller from a spec; YAML defaults first, then the spec's overrides."""
    name, overrides = parse_spec(spec)
    cls = controller_class(name)
    names = ([field.name for field in dataclasses.fields(cls) if field.init and not field.name.startswith("_")]
             if dataclasses.is_dataclass(cls) else [])
    if POSITIONAL in overrides:
        positional = getattr(cls, "positional_parameter", None)
        if positional is None:
            raise ValueError(f"controller spec {spec!r}: expected key=value after ':', got {overrides[POSITIONAL]!r}")
        overrides[positional] = overrides.pop(POSITIONAL)
    params = {**config_defaults(name), **overrides}
    fields = set(names)
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"controller {name!r} has no parameter(s) {unknown}; "
                         f"its parameters are {sorted(fields) or 'none'}")
    return cls(**params)
