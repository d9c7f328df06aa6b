"""Evaluation samples from data sets people already have, read through Hugging Face ``datasets``.

``load_samples(path_or_id)`` takes a local JSONL / JSON / Parquet file, a local folder of them, or a hub id
(online only), and accepts two schemas:

- **kvpress** (NVIDIA kvpress's benchmarks: RULER, LongBench, ...): ``context``, ``question``, and optionally
  ``answer_prefix``, ``answers`` (a list) or ``answer`` (a string or a list), ``max_new_tokens``, ``task``;
- **SCBench** (multi-turn over a shared context): ``context`` and ``multi_turns``, a list of
  ``{"input": question, "answer": gold}``; every turn after the first becomes a ``Turn``.

Scoring: ``string_match_all`` (every gold string appears in the answer), as kvpress scores RULER; a
``metric`` column may override it per row. A row's task is its ``task`` column, else the data set's name.
"""

from __future__ import annotations

from pathlib import Path

from eval.tasks.base import Sample, Turn

DEFAULT_MAX_NEW_TOKENS = 64
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SCHEMAS = {"kvpress": ("context", "question"), "scbench": ("context", "multi_turns")}


def _first_row_keys(path: Path, path_or_id: str) -> list[str]:
    """The columns of a local JSON / JSONL file's first row; a file without rows is an error naming it."""
    import json

    with open(path, encoding="utf-8") as f:
        if path.suffix.lower() == ".jsonl":
            first = next((line for line in f if line.strip()), None)
            try:
                row = None if first is None else json.loads(first)
            except json.JSONDecodeError as err:
                raise ValueError(f"--dataset {path_or_id!r}: {path.name} line 1 is not JSON ({err.msg})") from None
        else:
            try:
                data = json.load(f) if path.stat().st_size else []
            except json.JSONDecodeError as err:
                raise ValueError(f"--dataset {path_or_id!r}: {path.name} is not JSON ({err.msg})") from None
            row = (data[0] if data else None) if isinstance(data, list) else data
    if row is None:
        raise ValueError(f"--dataset {path_or_id!r}: {path.name} holds no rows")
    if not isinstance(row, dict):
        raise ValueError(f"--dataset {path_or_id!r}: {path.name}'s rows must be JSON objects, got {type(row).__name__}")
    return sorted(row)


def _check_json_files(files: list[Path], path_or_id: str) -> None:
    """Local JSON files, before ``datasets`` reads them: each holds rows, all with the same columns."""
    columns = {f.name: _first_row_keys(f, path_or_id) for f in files if DATA_SUFFIXES[f.suffix.lower()] == "json"}
    if len({tuple(keys) for keys in columns.values()}) > 1:
        listed = "; ".join(f"{name}: {', '.join(keys)}" for name, keys in columns.items())
        raise ValueError(f"--dataset {path_or_id!r}: its files have different columns ({listed}); keep one schema "
                         "per folder, or name a file")


def _open(path_or_id: str, split: str | None):
    import datasets

    datasets.disable_progress_bars()
    path = Path(path_or_id).expanduser()
    try:
        if path.is_file():
            kind = DATA_SUFFIXES.get(path.suffix.lower())
            if kind is None:
                raise ValueError(f"--dataset {path_or_id!r}: a file must be .jsonl, .json or .parquet")
            _check_json_files([path], path_or_id)
            return datasets.load_dataset(kind, data_files=str(path), split=split or "train")
        if path.is_dir():
            data_files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in DATA_SUFFIXES)
            kinds = {DATA_SUFFIXES[f.suffix.lower()] for f in data_files}
            if not data_files:
                raise ValueError(f"--dataset {path_or_id!r}: the folder holds no .jsonl, .json or .parquet file")
            if len(kinds) > 1:
                raise ValueError(f"--dataset {path_or_id!r}: the folder mixes JSON and Parquet files "
                                 f"({', '.join(f.name for f in data_files)}); `datasets` would read only one kind: "
                                 "keep one kind per folder, or name a file")
            _check_json_files(data_files, path_or_id)
            loaded = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in data_files], split=split or "train")
        else:
            loaded = datasets.load_dataset(path_or_id, split=split)
    except ValueError:
        raise
    except Exception as err:  # datasets raises many kinds (offline, missing files, bad data)
        raise ValueError(f"--dataset {path_or_id!r}: could not be read ({type(err).__name__}: {err}); give a local "
                         "JSONL/Parquet file or folder, or a hub id with a network") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            if len(loaded) != 1:
                raise ValueError(f"--dataset {path_or_id!r} has splits {sorted(loaded)}; choose one with --dataset-split")
            split = next(iter(loaded))
        if split not in loaded:
            raise ValueError(f"--dataset-split {split!r}: {path_or_id!r} has splits {sorted(loaded)}")
        loaded = loaded[split]
    return loaded


def _gold(row: dict, where: str) -> list[str]:
    value = row.get("answers") if row.get("answers") is not None else row.get("answer")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{where}: 'answers' / 'answer' must be a non-empty string or list of strings")
    return list(value)


def sample_from_row(row: dict, name: str, index: int) -> Sample:
    """One ``Sample`` from a row in either schema (see the module docstring)."""
    where = f"--dataset {name} row {index}"
    task = str(row.get("task") or name)
    metric = row.get("metric") or "string_match_all"
    max_new = row.get("max_new_tokens")
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    if isinstance(max_new, float) and max_new.is_integer():
        max_new = int(max_new)  # Parquet and pandas store an integer column with gaps as floats
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"{where}: 'max_new_tokens' must be a positive integer (or absent: {DEFAULT_MAX_NEW_TOKENS}), "
                         f"got {max_new!r}")
    if not isinstance(row.get("context"), str) or not row["context"].strip():
        raise ValueError(f"{where}: 'context' must be a non-empty string")
    if row.get("answer_prefix") is not None and not isinstance(row["answer_prefix"], str):
        raise ValueError(f"{where}: 'answer_prefix' must be a string, got {row['answer_prefix']!r}")
    common = {"task": task, "length": 0, "seed": 0, "index": index, "metric": metric, "max_new_tokens": max_new}
    if "multi_turns" in row and row["multi_turns"] is not None:
        turns = row["multi_turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'multi_turns' has no turns; a multi-turn sample needs at least one "
                             "{{input, answer}}")
        parsed = []
        for number, turn in enumerate(turns, start=1):
            if not isinstance(turn, dict) or not isinstance(turn.get("input"), str) or not turn["input"].strip():
                raise ValueError(f"{where}: turn {number} of 'multi_turns' needs an 'input' question")
            parsed.append((turn["input"], _gold(turn, f"{where} turn {number}")))
        (question, outputs), later = parsed[0], parsed[1:]
        return Sample.from_parts(context=row["context"], question="\n" + question, answer_prefix="",
                                 outputs=outputs, turns=[Turn("\n" + q, o) for q, o in later], **common)
    if not isinstance(row.get("question"), str):
        raise ValueError(f"{where}: 'question' must be a string")
    return Sample.from_parts(context=row["context"], question=row["question"],
                             answer_prefix=row.get("answer_prefix") or "", outputs=_gold(row, where), **common)


def load_samples(path_or_id: str, split: str | None = None, limit: int | None = None) -> list[Sample]:
    """Samples of a data set in the kvpress or SCBench schema; ``limit`` keeps the first ``limit`` rows of
    each task, in file order (all when None). Missing columns are an error naming them."""
    data = _open(path_or_id, split)
    columns = set(data.column_names)
    schema = next((name for name, needed in SCHEMAS.items() if set(needed) <= columns), None)
    if schema is None:
        raise ValueError(f"--dataset {path_or_id!r} has columns {sorted(columns)}; it needs 'context' and "
                         "'question' (kvpress schema: plus 'answers' or 'answer') or 'context' and 'multi_turns' "
                         "(SCBench schema)")
    if schema == "kvpress" and not {"answers", "answer"} & columns:
        raise ValueError(f"--dataset {path_or_id!r}: the kvpress schema needs an 'answers' or 'answer' column "
                         f"(it has {sorted(columns)})")
    name = Path(str(path_or_id).rstrip("/")).stem or "dataset"
    samples, per_task = [], {}
    for index, row in enumerate(data):
        sample = sample_from_row(dict(row), name, index)
        count = per_task.get(sample.task, 0)
        if limit is None or count < limit:
            per_task[sample.task] = count + 1
            sample.index = count
            samples.append(sample)
    if not samples:
        raise ValueError(f"--dataset {path_or_id!r} holds no rows")
    return samples
