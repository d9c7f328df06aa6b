"""Scoring of generated answers (RULER's `scripts/eval/synthetic/constants.py`, `baselines.md` §6.1).

* ``string_match_all`` -- the fraction of gold strings contained in the prediction (case-insensitive);
  1.0 only when every one is there (RULER averages the same per-sample value, x100);
* ``string_match_part`` -- 1.0 when any gold string is contained in the prediction (RULER's max over the
  references), else 0.0;
* ``exact`` -- passkey: the first integer in the prediction equals the gold number;
* ``kl`` -- natural-text continuation, scored by the harness from the model's distributions: ValueError.

The prediction is post-processed as in RULER: control characters become newlines, then surrounding
whitespace is stripped. Scores are in [0, 1]. ``sample`` is a :class:`eval.tasks.base.Sample` or a mapping
with the same fields (a row of a tasks file).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's post-processing: control characters to newlines, then strip."""
    return _CONTROL.sub("\n", prediction).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references contained in the prediction, case-insensitive."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    pred = postprocess(prediction).lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any reference is contained in the prediction, case-insensitive."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    pred = postprocess(prediction).lower()
    return float(max(ref.lower() in pred for ref in references))


def exact_number(prediction: str, references: Sequence[str]) -> float:
    """1.0 when the first integer in the prediction equals the (first) reference."""
    if not references:
        raise ValueError("exact needs a reference")
    match = re.search(r"\d+", prediction)
    return float(match is not None and match.group(0) == str(references[0]).strip())


SCORERS = {"string_match_all": string_match_all, "string_match_part": string_match_part,
           "exact": exact_number}


def score(sample, generated_text: str) -> float:
    """The score in [0, 1] of ``generated_text`` (the model's answer after the prompt) for ``sample``."""
    metric = sample["metric"] if isinstance(sample, Mapping) else sample.metric
    outputs = sample["outputs"] if isinstance(sample, Mapping) else sample.outputs
    task = sample.get("task", "?") if isinstance(sample, Mapping) else sample.task
    if metric == "kl":
        raise ValueError(f"task {task}: metric 'kl' is scored by the harness from the model's distributions, "
                         "not from generated text")
    if metric not in SCORERS:
        raise ValueError(f"task {task}: unknown metric {metric!r}")
    return SCORERS[metric](generated_text, list(outputs))
