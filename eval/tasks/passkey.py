"""Passkey retrieval (Landmark Attention / Quest's `evaluation/passkey/passkey.py` format).

A five-sentence filler line is repeated around the needle "The pass key is K. Remember it. K is the pass
key." placed at a given depth; the question ends the prompt ("What is the pass key? The pass key is").
K is drawn from 1..50000 with the sample's seed. Scoring: the first integer in the generated text equals K.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
          "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeySample:
    prompt: str
    answer: str
    depth: float
    seed: int


def passkey_sample(tokenizer, target_tokens: int, seed: int, depth: float | None = None) -> PasskeySample:
    """A prompt of about ``target_tokens`` tokens (±1 filler line) with the needle at ``depth`` (0..1;
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
