"""Passkey retrieval (Landmark Attention / Quest's `evaluation/passkey/passkey.py` format).

A five-sentence filler line is repeated around the needle "The pass key is K. Remember it. K is the pass
key." placed at a given depth; the question ends the prompt ("What is the pass key? The pass key is").
K is drawn from 1..50000 with the sample's seed. Scoring: the first integer in the generated text equals K.

Two entry points: :func:`passkey_sample` (the original, whole filler lines, about ``target_tokens``) and the
registered task ``passkey`` (``Sample`` interface, metric ``exact``, 10 new tokens as in Quest): the filler
is counted in sentences, the needle sits at a line boundary at a seed-drawn depth, and the number of
sentences is searched so that ``input + answer_prefix`` is as close as possible to the target length.
``input`` ends with "What is the pass key?" and ``answer_prefix`` is " The pass key is", so the prompt is
the same text as Quest's.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from eval.tasks.base import Sample, register_task
from eval.tasks.common import NOISE_SENTENCES, fit_length, make_rng

PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
          "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeySample:
    """A passkey prompt, its answer and the depth the key sits at."""
    prompt: str
    answer: str
    depth: float
    seed: int


def passkey_sample(tokenizer, target_tokens: int, seed: int, depth: float | None = None) -> PasskeySample:
    """A prompt of somewhat under ``target_tokens`` tokens (about 4 % short) with the needle at ``depth`` (0..1;
    drawn from the seed when None)."""
    if target_tokens < 64:
        raise ValueError(f"target_tokens must be at least 64 for a passkey prompt, got {target_tokens}")
    rng = random.Random(seed)
    passkey = rng.randint(1, 50000)
    depth = rng.random() if depth is None else depth
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    per_filler = len(tokenizer(FILLER).input_ids)
    fixed = len(tokenizer(PREFIX + " " + needle + QUESTION).input_ids)
    repeats = max((target_tokens - fixed) // per_filler, 1)
    before = round(repeats * depth)
    prompt = PREFIX + " " + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
    return PasskeySample(prompt=prompt, answer=str(passkey), depth=depth, seed=seed)


def score_passkey(generated: str, answer: str) -> bool:
    """Exact match of the first integer in the generated text."""
    match = re.search(r"\d+", generated)
    return match is not None and match.group(0) == answer


def _filler(first: int, count: int) -> str:
    """``count`` filler sentences starting at sentence ``first`` of the cycle, each followed by a space."""
    return "".join(NOISE_SENTENCES[(first + i) % 5] + " " for i in range(count))


@register_task("passkey")
def passkey(tokenizer, length: int, seed: int, index: int) -> Sample:
    """Passkey retrieval as a registered task (see the module docstring)."""
    rng = make_rng("passkey", seed, index)
    key = rng.randint(1, 50000)
    depth = rng.random()
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question, answer_prefix = QUESTION.split("?", 1)
    question += "?"

    def build(n: int) -> str:
        before = min(5 * round(n * depth / 5), n)
        return PREFIX + " " + _filler(0, before) + needle + _filler(before, n - before) + question

    n, text = fit_length(tokenizer, length, build, lambda t: t + answer_prefix, 0, 4 * length, what="passkey")
    return Sample(task="passkey", length=length, seed=seed, index=index, input=text, question=question,
                  answer_prefix=answer_prefix, outputs=[str(key)], metric="exact", max_new_tokens=10,
                  meta={"depth": depth, "needle": needle.strip(), "filler_sentences": n})
