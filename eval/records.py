"""The records of ``kvgym eval``: one JSON object per run in ``samples.jsonl`` (``RECORD_FIELDS``), keyed by
``record_key``; appending, reading back (a truncated last line dropped), the folder's settings
(``eval_config.json``) and its lock. ``eval.harness`` documents what a record holds and how a rerun resumes."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

KEY_FIELDS = ("controller", "budget", "task", "length", "index", "seed", "sample_hash")
RECORD_FIELDS = KEY_FIELDS + (
    "protocol", "sample_seed", "metric", "prompt_tokens", "context_tokens", "new_tokens", "text", "score",
    "turn_scores", "kl", "perplexity", "bytes_read_per_token", "bytes_moved_per_token", "decode_ms_per_token",
    "ttft_ms", "fallbacks", "budget_blocks", "peak_device_blocks", "operations",
)
TIMING_FIELDS = ("decode_ms_per_token", "ttft_ms")


def sample_hash(sample) -> str:
    """A hash of what a sample asks and expects (text, answer prefix, gold answers, turns, metric)."""
    content = {"input": sample.input, "question": sample.question, "answer_prefix": sample.answer_prefix,
               "outputs": list(sample.outputs), "metric": sample.metric, "continuation": sample.continuation,
               "max_new_tokens": sample.max_new_tokens,
               "turns": [[t.question, t.answer_prefix, list(t.outputs)] for t in sample.turns]}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def controller_digest(spec: str) -> str | None:
    """A digest (sha256, 16 hex digits) of the files the controller of ``spec`` reads, those it names
    (``ranker:policies/x.pt``) and those it uses by default (a plain ``ranker``: the shipped file), or None when
    it reads none."""
    from agents.registry import resolved_parameters

    files = [Path(value) for value in resolved_parameters(spec).values()
             if isinstance(value, str) and value and Path(value).is_file()]
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def record_key(record: dict) -> tuple:
    """What makes two records the same run: controller, budget, task, length, index, seed and sample hash."""
    return (str(record["controller"]), float(record["budget"]), str(record["task"]), int(record["length"]),
            int(record["index"]), int(record["seed"]), str(record.get("sample_hash", "")))


def append_record(path: Path, record: dict) -> None:
    """Append ``record`` as one line of ``path``, on a line of its own even when the file's last line lacks its
    newline (a run killed between the two writes of an older kvgym, or an edited file)."""
    line = json.dumps(record) + "\n"
    with open(path, "a+b") as sink:
        if sink.tell() > 0:
            sink.seek(-1, os.SEEK_END)
            if sink.read(1) != b"\n":
                line = "\n" + line
        sink.write(line.encode("utf-8"))


def load_records(path: Path) -> dict[tuple, dict]:
    """Records already in ``samples.jsonl`` by key; a truncated last line is dropped (file rewritten)."""
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    records: dict[tuple, dict] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key = record_key(record)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            if number == len(lines) and not path.read_text(encoding="utf-8").endswith("\n"):
                warnings.warn(f"{path}: dropping the truncated last line {number} (an interrupted write)", stacklevel=2)
                path.write_text("".join(f"{kept}\n" for kept in lines[: number - 1] if kept.strip()), encoding="utf-8")
                break
            raise ValueError(f"{path} line {number}: not a sample record ({err}); fix or remove the line") from None
        records[key] = record
    return records


CONFIG_DEFAULTS = {"budget_scope": None}  # settings added later: what a folder written before them ran with


def check_config(out: Path, config: dict) -> None:
    """Write ``out/eval_config.json`` on a folder's first run; refuse a rerun whose settings differ from it (a
    damaged file is named with the fix)."""
    path = out / "eval_config.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if not isinstance(old, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:  # an empty or damaged file (json's errors are ValueErrors)
            raise ValueError(f"{path} is empty or damaged ({err}); remove it to rewrite it from this run's settings "
                             "(samples.jsonl is kept), or use a fresh --out") from None
        changed = {k: (old.get(k, CONFIG_DEFAULTS.get(k)), v) for k, v in config.items()
                   if old.get(k, CONFIG_DEFAULTS.get(k)) != v}
        if changed:
            details = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise ValueError(f"{out} holds results made with other settings ({details}); use a fresh --out")
    else:
        from agents.policy_file import atomic_write

        with atomic_write(path, ".json") as tmp:
            Path(tmp).write_text(json.dumps(config, indent=2) + "\n")


@contextmanager
def exclusive_folder(out: Path):
    """Hold ``out/.eval.lock`` (an OS lock, released when the process ends, killed or not): a second eval into
    the same folder while one runs is refused instead of writing duplicated rows."""
    import fcntl

    handle = open(out / ".eval.lock", "a+")  # noqa: SIM115  (held for the whole block)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"--out {out}: another kvgym eval is writing to this folder; wait for it to finish "
                             "or give another --out") from None
        yield
    finally:
        handle.close()


REFERENCES = "references"  # the folder's subfolder of saved full-cache logits (``save_reference``)


def save_reference(out: Path, sample_hash_value: str, first_logits) -> None:
    """Keep the full cache's logits at the first generated position of sample ``sample_hash_value`` (all a later
    run of an answer task needs from the reference: its ``kl``) in ``out/references/<hash>.pt``, written atomically
    (float32, ~200 KB at SmolLM2's vocabulary)."""
    import torch

    from agents.policy_file import atomic_write

    with atomic_write(Path(out) / REFERENCES / f"{sample_hash_value}.pt", ".pt") as tmp:
        torch.save({"sample_hash": sample_hash_value, "first_logits": first_logits.detach().float().cpu()}, tmp)


def load_reference(out: Path, sample_hash_value: str):
    """The first-position logits ``save_reference`` kept for ``sample_hash_value`` (a 1-D float tensor), or None when
    there are none; an unreadable or foreign file is ignored with a warning (the reference then runs again)."""
    import torch

    path = Path(out) / REFERENCES / f"{sample_hash_value}.pt"
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        logits = payload["first_logits"]
        if payload["sample_hash"] != sample_hash_value or logits.dim() != 1 or not logits.is_floating_point():
            raise ValueError("another sample's logits")
    except Exception as error:  # noqa: BLE001  (torch raises many kinds for a damaged file)
        warnings.warn(f"{path}: unreadable saved reference ({type(error).__name__}: {error}); the full cache runs "
                      "again for this sample", stacklevel=2)
        return None
    return logits
