"""Multi-turn tasks: one shared context, then several questions, each asked after the previous answer.

Long-horizon use of a cache (a conversation, an agent's working memory) asks more than one question of the
same context; query-aware compression that serves the first question can fail the next ones (SCBench,
arXiv 2412.10319). Each task has ``NUM_TURNS`` turns, and its ``*5`` twin (``mt_niah5``, ``mt_kv5``,
``mt_passkey5``) has five, as the benchmark's long-horizon setting asks; the first turn's question ends ``input``
like a single-turn sample, the later ones are ``Sample.turns`` (each starts on a new line). Run them with
``--protocol multiturn``; every turn is scored on its own and a sample's score is the mean.

| task | context | per turn | metric |
|---|---|---|---|
| ``mt_niah`` | RULER noise haystack with ``NUM_TURNS`` needles "One of the special magic numbers for {key} is: {value}." at distinct RULER depths | the value of one key (keys asked in random order) | ``string_match_all`` |
| ``mt_kv`` | SCBench retr.kv: a JSON object of random UUID keys and values | the value of one key (distinct keys, random order) | ``string_match_all`` |
| ``mt_passkey`` | passkey filler with ``NUM_TURNS`` labelled pass keys ("The red pass key is K. Remember it.") | one label's pass key | ``exact`` |
"""

from __future__ import annotations

import json
import uuid
from functools import partial

from eval.tasks.base import Sample, Turn, register_task
from eval.tasks.common import DEPTHS, depth_position, fit_length, interleave, make_rng, noise_lines
from eval.tasks.niah import NEEDLE
from eval.tasks.passkey import PREFIX as PASSKEY_PREFIX

NUM_TURNS = 3
LONG_TURNS = 5
MAX_NEW_TOKENS = 24
LABELS = ("red", "blue", "green", "yellow", "white", "black")


def _split_turns(rng, asked: list[tuple[str, str, str]]) -> tuple[tuple[str, str, str], list[Turn]]:
    """(question, answer prefix, gold) triples in random order → the first turn and the later ``Turn``s."""
    asked = list(asked)
    rng.shuffle(asked)
    first, later = asked[0], asked[1:]
    return first, [Turn("\n" + q, [gold], prefix) for q, prefix, gold in later]


def _sample(tokenizer, task, length, seed, index, build, first, turns, metric, meta, n_min, n_max) -> Sample:
    """The sample whose context (``build(n)``) brings the first turn's prompt closest to ``length`` tokens."""
    question, answer_prefix, gold = first
    n, context = fit_length(tokenizer, length, build, lambda c: c + question + answer_prefix, n_min, n_max, what=task)
    meta["haystack_units"] = n
    return Sample.from_parts(task=task, length=length, seed=seed, index=index, context=context, question=question,
                             answer_prefix=answer_prefix, outputs=[gold], metric=metric,
                             max_new_tokens=MAX_NEW_TOKENS, turns=turns, meta=meta)


def mt_niah(tokenizer, length: int, seed: int, index: int, turns: int = NUM_TURNS, task: str = "mt_niah") -> Sample:
    """``turns`` needles in the noise haystack; one key asked per turn, in random order."""
    from eval.tasks.common import random_keys, random_numbers

    rng = make_rng(task, seed, index)
    keys = random_keys(rng, turns)
    values = [str(v) for v in random_numbers(rng, turns, 1_000_000, 9_999_999)]
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
    depths = [d / 100 for d in rng.sample(DEPTHS, turns)]
    head = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
            "I will quiz you about the numbers afterwards.\n")

    def build(n: int) -> str:
        lines = noise_lines(n)
        return head + "\n".join(interleave(lines, [(depth_position(d, len(lines)), s)
                                                   for d, s in zip(depths, needles, strict=True)])) + "\n"

    asked = [(f"What is the special magic number for {k} mentioned in the provided text?",
              f" The special magic number for {k} mentioned in the provided text is", v)
             for k, v in zip(keys, values, strict=True)]
    first, later = _split_turns(rng, asked)
    return _sample(tokenizer, task, length, seed, index, build, first, later, "string_match_all",
                   {"keys": keys, "values": values, "depths": depths}, 0, 4 * length)


def mt_kv(tokenizer, length: int, seed: int, index: int, turns: int = NUM_TURNS, task: str = "mt_kv") -> Sample:
    """SCBench's retr.kv shape: a JSON object of UUID pairs; one key looked up per turn."""
    rng = make_rng(task, seed, index)
    pool = [(str(uuid.UUID(int=rng.getrandbits(128), version=4)), str(uuid.UUID(int=rng.getrandbits(128), version=4)))
            for _ in range(length // 16 + turns + 8)]
    asked_positions = [p / 100 for p in rng.sample(DEPTHS, turns)]
    head = "Extract the value corresponding to the specified key in the JSON object below.\n\n"

    def pairs(n: int) -> list[tuple[str, str]]:
        return pool[: max(n, turns)]

    def asked_pairs(n: int) -> list[tuple[str, str]]:
        items = pairs(n)
        return [items[min(int(p * len(items)), len(items) - 1)] for p in asked_positions]

    def build(n: int) -> str:
        return head + json.dumps(dict(pairs(n)), indent=None) + "\n"

    # the asked keys depend on the size; fix it first with a provisional question, then ask
    n, _ = fit_length(tokenizer, length, build, lambda c: c + "Key: \"" + pool[0][0] + "\"\nThe value associated "
                      "with the specified key is:", turns, len(pool), what=task)
    chosen = list(dict.fromkeys(asked_pairs(n)))
    while len(chosen) < turns:  # distinct keys even when two depths land on one pair
        extra = pairs(n)[rng.randrange(min(n, len(pool)))]
        if extra not in chosen:
            chosen.append(extra)
    asked = [(f"Key: \"{k}\"", "\nThe value associated with the specified key is:", v) for k, v in chosen]
    first, later = _split_turns(rng, asked)
    question, answer_prefix, gold = first
    context = build(n)
    return Sample.from_parts(task=task, length=length, seed=seed, index=index, context=context, question=question,
                             answer_prefix=answer_prefix, outputs=[gold], metric="string_match_all",
                             max_new_tokens=32, turns=later, meta={"pairs": n, "asked": chosen})


def mt_passkey(tokenizer, length: int, seed: int, index: int, turns: int = NUM_TURNS,
               task: str = "mt_passkey") -> Sample:
    """``turns`` labelled pass keys in the passkey filler; one label asked per turn."""
    from eval.tasks.passkey import _filler

    rng = make_rng(task, seed, index)
    labels = rng.sample(LABELS, turns)
    keys = [str(rng.randint(1, 50000)) for _ in labels]
    depths = sorted(rng.random() for _ in labels)
    needles = [f"The {label} pass key is {key}. Remember it. {key} is the {label} pass key. "
               for label, key in zip(labels, keys, strict=True)]

    def build(n: int) -> str:
        cuts = [min(5 * round(n * d / 5), n) for d in depths]
        text, last = PASSKEY_PREFIX + " ", 0
        for cut, needle in zip(cuts, needles, strict=True):
            text += _filler(last, cut - last) + needle
            last = cut
        return text + _filler(last, n - last)

    asked = [(f"What is the {label} pass key?", f" The {label} pass key is", key)
             for label, key in zip(labels, keys, strict=True)]
    first, later = _split_turns(rng, asked)
    return _sample(tokenizer, task, length, seed, index, build, first, later, "exact",
                   {"labels": labels, "keys": keys, "depths": depths}, 0, 4 * length)


for _generator in (mt_niah, mt_kv, mt_passkey):
    register_task(_generator.__name__)(_generator)
    register_task(_generator.__name__ + "5")(partial(_generator, turns=LONG_TURNS, task=_generator.__name__ + "5"))
