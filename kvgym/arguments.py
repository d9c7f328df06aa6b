"""The command line's argument types and shared flags (``kvgym.cli`` and ``benchmarks.ranker_tools``): each bad
value is an ``argparse`` error that names it and says what is accepted, before any model is loaded."""

from __future__ import annotations

import argparse
from importlib import resources

BUNDLED_PROMPT = "alice_chapter1.txt"
PROTOCOL_CHOICES = ("streaming", "oneshot", "oneshot-question", "multiturn")  # cache.runner.PROTOCOLS


def bundled_prompt() -> str:
    """The demo prompt shipped with the package."""
    return resources.files("kvgym").joinpath("prompts", BUNDLED_PROMPT).read_text()


def parse_budget(text: str | None):
    """``0.25`` → a fraction of the context; ``64`` → blocks per layer; ``none``/``full`` → no budget
    (``cache.runner.parse_budget``, the one budget parser)."""
    from cache.runner import parse_budget as parse

    try:
        return parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_int_list(text: str) -> list[int]:
    """Comma-separated integers; an error names the bad value."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers like 512,2048") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def parse_fraction_list(text: str) -> list[float]:
    """Comma-separated fractions in (0, 1]; an error names the bad value."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated fractions like 0.125,0.25") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected fractions in (0, 1]")
    return values


def checked_tasks(text: str) -> list[str]:
    """Comma-separated task names, each looked up so that an unknown task fails before the model is loaded."""
    from eval.tasks.base import get_task

    tasks = [t.strip() for t in text.split(",") if t.strip()]
    for task in tasks:
        get_task(task)
    return tasks


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--device`` and ``--dtype``."""
    from cache.models import DEFAULT_MODEL, MODEL_ALIASES

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"alias ({', '.join(sorted(MODEL_ALIASES))}), local checkpoint folder, or hub id")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)")
