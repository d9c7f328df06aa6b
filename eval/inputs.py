"""What ``kvgym eval`` is given, checked before anything runs: controller specs, budgets, tasks, lengths, sample
counts, and the samples of a ``--tasks-file`` (one JSON object per line). ``eval.harness`` runs them."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

FULL = "full"  # the full cache's controller spec (always run: the reference)
CUSTOM_METRICS = ("string_match_all", "string_match_part", "exact")
TASKS_FILE_KEYS = {"input": "input, or context + question", "context": "optional", "question": "optional",
                   "outputs": "required", "metric": "required", "answer_prefix": "optional", "max_new_tokens": "optional"}


def available_tasks() -> list[str]:
    """Every registered task name."""
    import eval.tasks  # noqa: F401  (registration)
    from eval.tasks.base import TASKS

    return sorted(TASKS)


def task_generator(name: str):
    """The registered generator of ``name``; an unknown name is a ``--tasks`` error."""
    from eval.tasks.base import get_task

    try:
        return get_task(name)
    except ValueError as err:
        raise ValueError(f"--tasks: {err}") from None


def split_specs(text: str) -> list[str]:
    """``"lru,h2o:heavy_ratio=0.25,recent_ratio=0.25,full"`` → ``["lru", "h2o:heavy_ratio=0.25,recent_ratio=0.25", "full"]``:
    a comma-separated piece with ``=`` and no ``:`` is a parameter of the spec before it."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def _as_list(value, flag: str) -> list:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    value = list(value)
    if not value:
        raise ValueError(f"{flag}: the list is empty; give at least one value")
    return value


def check_inputs(controllers, budgets, tasks, lengths, n, max_positions: int | None = None):
    """Normalise and validate; errors name the command-line flag. Returns (specs, budgets, tasks, lengths)."""
    from agents.registry import make_controller, parse_spec

    specs = split_specs(controllers) if isinstance(controllers, str) else [str(c).strip() for c in controllers]
    if not specs:
        raise ValueError("--controllers: the list is empty; give at least one controller (e.g. lru,h2o,full)")
    for spec in specs:
        make_controller(spec)  # the registry's error for an unknown name or parameter
    names = [parse_spec(spec)[0] for spec in specs]
    specs = [FULL if name == FULL else spec for spec, name in zip(specs, names, strict=True)]
    specs = list(dict.fromkeys(specs))

    budget_list = []
    for value in _as_list(budgets, "--budgets"):
        try:
            budget = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"--budgets: {value!r} is not a number; give fractions in (0, 1] like 0.25") from None
        if not 0.0 < budget <= 1.0 or math.isnan(budget):
            raise ValueError(f"--budgets: {value!r} is outside (0, 1]; a budget is a fraction of the context's tokens")
        budget_list.append(budget)
    budget_list = sorted(set(budget_list))

    task_list = list(dict.fromkeys(str(t).strip() for t in _as_list(tasks, "--tasks"))) if tasks is not None else []

    length_list = []
    for value in _as_list(lengths, "--lengths") if tasks is not None else []:
        try:
            length = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"--lengths: {value!r} is not an integer token count") from None
        if length <= 0:
            raise ValueError(f"--lengths: {value!r} must be a positive token count")
        if max_positions is not None and length >= max_positions:
            raise ValueError(f"--lengths: {length} tokens leave no room to answer within the model's "
                             f"{max_positions} positions")
        length_list.append(length)
    length_list = list(dict.fromkeys(length_list))

    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"--n: the number of samples per task and length must be a positive integer, got {n!r}")
    return specs, budget_list, task_list, length_list


def tasks_file_task(path: str | Path) -> str:
    """The task name of a tasks file's samples: its name without ``.gz`` and ``.jsonl`` (``mine.jsonl.gz`` →
    ``mine``)."""
    return Path(Path(path).name.removesuffix(".gz")).stem


def read_tasks_file(path: str | Path) -> list[dict]:
    """Parse a JSONL file of user samples (gzip-compressed when its name ends in ``.gz``); a malformed line raises
    ``ValueError("F.jsonl line 3: ...")``.

    Each non-blank line is an object with ``input`` (non-empty string) or ``context`` and ``question`` (strings;
    ``input`` may be given too and must then equal their concatenation), ``outputs`` (non-empty list of
    strings), ``metric`` (string_match_all | string_match_part | exact) and optionally ``answer_prefix``
    (string, default "") and ``max_new_tokens`` (positive integer, default 32). Other keys are refused (a
    misspelt key would otherwise be ignored). Blank lines are skipped.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"--tasks-file: {str(path)!r} does not exist or is not a file")
    entries, seen = [], {}
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue

            def bad(message, number=number):
                return ValueError(f"{path.name} line {number}: {message}")

            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise bad(f"not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(item, dict):
                raise bad(f"expected a JSON object, got {type(item).__name__}")
            unknown = sorted(set(item) - set(TASKS_FILE_KEYS))
            if unknown:
                raise bad(f"unknown key(s) {unknown}; the keys are {', '.join(TASKS_FILE_KEYS)}")
            missing = [k for k, need in TASKS_FILE_KEYS.items() if need == "required" and k not in item]
            if "input" not in item and not ("context" in item and "question" in item):
                missing.insert(0, "input (or context and question)")
            if missing:
                raise bad(f"missing key(s) {missing}")
            for key in ("context", "question"):
                if key in item and not isinstance(item[key], str):
                    raise bad(f"'{key}' must be a string")
            question = item.get("question", "")
            if "context" in item:
                joined = item["context"] + question
                if "input" in item and item["input"] != joined:
                    raise bad("'input' must equal 'context' + 'question' when all three are given")
                item["input"] = joined
            elif question and not str(item["input"]).endswith(question):
                raise bad("'question' must be the end of 'input'")
            if not isinstance(item["input"], str) or not item["input"].strip():
                raise bad("'input' must be a non-empty string")
            prefix = item.get("answer_prefix", "")
            if not isinstance(prefix, str):
                raise bad("'answer_prefix' must be a string (may be empty)")
            outputs = item["outputs"]
            if (not isinstance(outputs, list) or not outputs
                    or not all(isinstance(o, str) and o.strip() for o in outputs)):
                raise bad("'outputs' must be a non-empty list of non-empty strings (the gold answers)")
            if item["metric"] not in CUSTOM_METRICS:
                raise bad(f"'metric' {item['metric']!r} is not one of {', '.join(CUSTOM_METRICS)}")
            max_new = item.get("max_new_tokens", 32)
            if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new <= 0:
                raise bad(f"'max_new_tokens' must be a positive integer, got {max_new!r}")
            entry = {"input": item["input"], "question": question, "answer_prefix": prefix, "outputs": list(outputs),
                     "metric": item["metric"], "max_new_tokens": max_new}
            content = json.dumps(entry, sort_keys=True)
            if content in seen:
                raise bad(f"repeats line {seen[content]} (the same sample would run and count twice); remove one")
            seen[content] = number
            entries.append({**entry, "line": number})
    if not entries:
        raise ValueError(f"--tasks-file: {path.name} holds no samples")
    return entries


def length_bucket(tokens: int) -> int:
    """The power of two at or above ``tokens`` (custom samples are grouped by it)."""
    return 1 << max(int(tokens) - 1, 0).bit_length()


def check_eval_args(args, default_tasks: str) -> tuple[str | None, dict | None]:
    """Everything ``kvgym eval``'s flags (``args``) can be checked for before the model loads; returns the task
    list it runs (``default_tasks`` unless tasks, a tasks file, a dataset or a family split are given) and the Ray
    settings (None without ``--ray``)."""
    tasks = args.tasks if args.tasks is not None else (
        None if args.tasks_file or args.dataset or args.family_split else default_tasks)
    if args.family_split is not None:
        from eval.tasks.families import FAMILY_TASKS

        tasks = ",".join(t for t in [tasks, FAMILY_TASKS[args.family_split]] if t)
    # everything that can be checked without the model is checked before loading it
    _, _, task_list, _ = check_inputs(args.controllers, args.budgets, tasks, args.lengths, args.n)
    for task in task_list:
        task_generator(task)
    if args.tasks_file is not None:
        read_tasks_file(args.tasks_file)
    if args.dataset is not None:
        from eval.datasets import load_samples

        load_samples(args.dataset, split=args.dataset_split, limit=args.n)
    if args.block_size < 1:
        raise ValueError(f"--block-size {args.block_size}: must be a positive integer")
    ray = None
    if args.ray is not None:
        if args.ray_workers is not None and args.ray_workers < 1:
            raise ValueError(f"--ray-workers {args.ray_workers}: give a positive number of workers")
        try:
            import ray as _  # noqa: F401  (only to say early that it is missing)
        except ImportError:
            raise ValueError("--ray: Ray is not installed; pip install 'kvgym[ray]' (or pip install ray)") from None
        ray = {"address": args.ray, "workers": args.ray_workers, "model": args.model, "device": args.device,
               "dtype": args.dtype}
    return tasks, ray
