"""Controllers by name, with parameters from ``configs/controllers/<name>.yaml`` and command-line overrides.

A spec is ``name`` or ``name:key=value,key=value`` (values parsed as YAML: ``0.98``, ``true``, ``[1, 2]``); a
controller with a ``positional_parameter`` takes a bare first value for it (``ranker:policies/ranker_smollm2.pt``).
The same specs serve the CLI (``--controller h2o:recent_tokens=128``), the environment and the evaluation.
Every parameter, from the YAML defaults or the spec, is checked against the type its dataclass field declares
before the controller is built (``check_parameter``): a wrong one is a ``ValueError`` naming the controller,
the parameter, the value and the accepted type.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
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
    "knorm": "agents.baselines.knorm:Knorm",
    "keydiff": "agents.baselines.keydiff:KeyDiff",
    "expected_attention": "agents.baselines.expected_attention:ExpectedAttention",
    "kvzip": "agents.baselines.kvzip:KVzip",
    "pyramidkv": "agents.baselines.pyramidkv:PyramidKV",
    "observed_attention": "agents.baselines.observed_attention:ObservedAttention",
    "oracle": "agents.baselines.oracle:Oracle",
    "lookahead": "agents.baselines.lookahead:Lookahead",
    "ranker": "agents.ranker.controller:RankerController",
}


LEARNED = {"ranker"}  # controllers loaded from a trained file (the rest are the baselines)
BASELINES = sorted(set(CONTROLLERS) - LEARNED)

POSITIONAL = "<positional>"  # parse_spec's key for a bare first value


def register(name: str, target: str) -> None:
    """Add a controller class under ``name`` (``target`` = ``"module:Class"``)."""
    CONTROLLERS[name] = target


def controller_class(name: str, table: dict[str, str] = CONTROLLERS):
    """The controller class registered as ``name`` (imported on demand)."""
    if name not in table:
        raise ValueError(f"unknown controller {name!r}: choose from {', '.join(sorted(table))}")
    module, _, cls = table[name].partition(":")
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
        try:
            overrides[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(f"controller spec {spec!r}: cannot read the value of {item!r} (a number, a word, "
                             "true/false or null; ',' separates parameters)") from None
    return name.strip().lower(), overrides


def config_defaults(name: str) -> dict:
    """The defaults a controller's YAML config file gives (empty when it has none)."""
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of parameter names to values")
    return data


def _type_name(annotation) -> str:
    if annotation is type(None):
        return "null"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(annotation))
    names = {float: "a finite number", int: "an integer", str: "a string", bool: "true or false"}
    return names.get(annotation) or getattr(annotation, "__name__", str(annotation))


def _convert(value, annotation):
    """``value`` as ``annotation`` (an int is a valid float; YAML reads ``1e-3`` as a string, so a numeric string
    is a valid float too; NaN and infinities are not); raises ``TypeError`` when it is not one."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _convert(value, option)
            except TypeError:
                pass
        raise TypeError
    if annotation is type(None):
        if value is None:
            return None
        raise TypeError
    if annotation is float:
        try:
            number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is None or not math.isfinite(number):
            raise TypeError
        return number
    if annotation is int and isinstance(value, bool):
        raise TypeError
    origin = typing.get_origin(annotation) or annotation
    if annotation is typing.Any or (isinstance(origin, type) and isinstance(value, origin)):
        return value
    raise TypeError


def check_parameter(controller: str, name: str, value, annotation, source: str = ""):
    """``value`` checked against (and, int → float, converted to) the declared type ``annotation`` of parameter
    ``name``; a ``ValueError`` naming the controller, the parameter, the value and the accepted type otherwise."""
    try:
        return _convert(value, annotation)
    except TypeError:
        raise ValueError(f"controller {controller!r}: parameter {name!r} must be {_type_name(annotation)}, "
                         f"got {value!r}{source}") from None


def resolved_parameters(spec: str, table: dict[str, str] = CONTROLLERS) -> dict:
    """Every parameter ``make_controller(spec)`` would pass, with the values it would leave to the class's own
    defaults filled in (what a record must name to say which controller ran: a default policy file included)."""
    name, overrides = parse_spec(spec)
    cls = controller_class(name, table)
    if POSITIONAL in overrides and getattr(cls, "positional_parameter", None):
        overrides[cls.positional_parameter] = overrides.pop(POSITIONAL)
    fields = {field.name: field.default for field in (dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ())
              if field.init and not field.name.startswith("_") and field.default is not dataclasses.MISSING}
    return {**fields, **config_defaults(name), **overrides}


def make_controller(spec: str, table: dict[str, str] = CONTROLLERS):
    """Build a controller from a spec; YAML defaults first, then the spec's overrides. ``table``: where names are
    looked up (default: the controllers)."""
    name, overrides = parse_spec(spec)
    cls = controller_class(name, table)
    names = ([field.name for field in dataclasses.fields(cls) if field.init and not field.name.startswith("_")]
             if dataclasses.is_dataclass(cls) else [])
    if POSITIONAL in overrides:
        positional = getattr(cls, "positional_parameter", None)
        if positional is None:
            raise ValueError(f"controller spec {spec!r}: expected key=value after ':', got {overrides[POSITIONAL]!r}")
        overrides[positional] = overrides.pop(POSITIONAL)
    defaults = config_defaults(name)
    params = {**defaults, **overrides}
    fields = set(names)
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"controller {name!r} has no parameter(s) {unknown}; "
                         f"its parameters are {sorted(fields) or 'none'}")
    required = [field.name for field in (dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ())
                if field.init and field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING and field.name not in params]
    if required:
        positional = getattr(cls, "positional_parameter", None)
        example = f"{name}:{positional.upper()}" if positional in required else f"{name}:{required[0]}=VALUE"
        raise ValueError(f"controller {name!r} needs parameter(s) {required}, e.g. {example!r}")
    hints = typing.get_type_hints(cls) if params else {}
    for key, value in params.items():
        source = f" (from {CONFIG_DIR / f'{name}.yaml'})" if key not in overrides else ""
        params[key] = check_parameter(name, key, value, hints.get(key, typing.Any), source)
    return cls(**params)
