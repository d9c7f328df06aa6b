"""RULER's needle-in-a-haystack family (`NVIDIA/RULER@scripts/data/synthetic/niah.py`, `baselines.md` §6.2).

Needle: "One of the special magic numbers for {key} is: {value}." -- keys are "adjective-noun" pairs from
the shipped word lists (RULER's ``words`` type), values random 7-digit numbers (``numbers``). Prompt:

    Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz
    you about the numbers afterwards.
    {context}
    What are all the special magic numbers for {query} mentioned in the provided text?

with the answer prefix " The special magic numbers for {query} mentioned in the provided text are", both
singularised ("A special magic number is hidden ...", "What is the special magic number ...", "... is")
when one value is asked for. Several queried keys are listed as "k1, k2, k3, and k4". Gold: the values
of the queried keys; metric ``string_match_all``; 128 new tokens.

| task | haystack | keys k | values per key v | queried q | RULER counterpart |
|---|---|---|---|---|---|
| niah_single | noise | 1 | 1 | 1 | niah_single_1 |
| niah_multikey | needle (distractor needles with other keys) | 1 | 1 | 1 | niah_multikey_2 |
| niah_multivalue | prose (Alice instead of essays) | 1 | 4 | 1 | niah_multivalue |
| niah_multiquery | prose (Alice instead of essays) | 4 | 1 | 4 | niah_multiquery |

Placement: each needle at a depth drawn (distinct) from RULER's 40 depths, as a line between noise lines
(a noise line holds the five filler sentences; the last may be partial), as a line among the distractor
needles, or between prose sentences. The needles are shuffled first, so in niah_multivalue the values do
not appear in the order of the gold list.
"""

from __future__ import annotations

from eval.tasks.base import Sample, register_task
from eval.tasks.common import (
    DEPTHS,
    depth_position,
    fit_length,
    insert_into_prose,
    interleave,
    last_line,
    make_rng,
    noise_lines,
    prose_parts,
    prose_window,
    random_keys,
    random_numbers,
)

NEEDLE = "One of the special magic numbers for {key} is: {value}."
TEMPLATE_MANY = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the numbers afterwards.\n{context}\n"
                 "What are all the special magic numbers for {query} mentioned in the provided text?")
PREFIX_MANY = " The special magic numbers for {query} mentioned in the provided text are"
TEMPLATE_ONE = ("A special magic number is hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the number afterwards.\n{context}\n"
                "What is the special magic number for {query} mentioned in the provided text?")
PREFIX_ONE = " The special magic number for {query} mentioned in the provided text is"
MAX_NEW_TOKENS = 128


def join_query(keys: list[str]) -> str:
    """RULER's query string: "a", "a and b", "a, b, and c"."""
    if len(keys) == 1:
        return keys[0]
    if len(keys) == 2:
        return f"{keys[0]} and {keys[1]}"
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


def niah_sample(task: str, haystack: str, num_keys: int, num_values: int, num_queries: int,
                tokenizer, length: int, seed: int, index: int) -> Sample:
    """One NIAH sample of about ``length`` tokens (see the module docstring)."""
    num_keys = max(num_keys, num_queries)
    rng = make_rng(task, seed, index)
    keys = random_keys(rng, num_keys)
    values = random_numbers(rng, num_keys * num_values, 1_000_000, 9_999_999)
    values_of = {key: values[i * num_values:(i + 1) * num_values] for i, key in enumerate(keys)}
    needles = [NEEDLE.format(key=key, value=value) for key in keys for value in values_of[key]]
    rng.shuffle(needles)
    depths = [d / 100 for d in rng.sample(DEPTHS, len(needles))]
    queries = rng.sample(keys, num_queries)
    outputs = [str(value) for key in queries for value in values_of[key]]
    query = join_query(queries)
    single = len(outputs) == 1
    template = TEMPLATE_ONE if single else TEMPLATE_MANY
    answer_prefix = (PREFIX_ONE if single else PREFIX_MANY).format(query=query)
    meta = {"haystack": haystack, "keys": keys, "queries": queries, "needles": needles, "depths": depths}

    if haystack == "noise":
        def context(n: int) -> str:
            lines = noise_lines(n)
            return "\n".join(interleave(lines, [(depth_position(d, len(lines)), s)
                                                for d, s in zip(depths, needles, strict=True)]))
        n_min, n_max = 0, 4 * length
    elif haystack == "needle":
        pool_size = length // 8 + 16
        pool_keys = random_keys(rng, pool_size, exclude=set(keys))
        pool_values = random_numbers(rng, pool_size, 1_000_000, 9_999_999, exclude=set(values))
        distractors = [NEEDLE.format(key=k, value=v) for k, v in zip(pool_keys, pool_values, strict=True)]

        def context(n: int) -> str:
            units = distractors[:n]
            return "\n".join(interleave(units, [(depth_position(d, len(units)), s)
                                                for d, s in zip(depths, needles, strict=True)]))
        n_min, n_max = 0, pool_size
    elif haystack == "prose":
        start = rng.choice(prose_parts()[2])
        meta["prose_start_word"] = start

        def context(n: int) -> str:
            return insert_into_prose(prose_window(start, n), list(zip(depths, needles, strict=True)))
        n_min, n_max = 0, 4 * length
    else:
        raise ValueError(f"unknown haystack {haystack!r}")

    def build(n: int) -> str:
        return template.format(context=context(n), query=query)

    n, text = fit_length(tokenizer, length, build, lambda t: t + answer_prefix, n_min, n_max, what=task)
    meta["haystack_units"] = n
    return Sample(task=task, length=length, seed=seed, index=index, input=text, question=last_line(text), answer_prefix=answer_prefix,
                  outputs=outputs, metric="string_match_all", max_new_tokens=MAX_NEW_TOKENS, meta=meta)


@register_task("niah_single")
def niah_single(tokenizer, length: int, seed: int, index: int) -> Sample:
    """One needle in the noise haystack (RULER niah_single_1)."""
    return niah_sample("niah_single", "noise", 1, 1, 1, tokenizer, length, seed, index)


@register_task("niah_multikey")
def niah_multikey(tokenizer, length: int, seed: int, index: int) -> Sample:
    """One needle among distractor needles with other keys (RULER niah_multikey_2)."""
    return niah_sample("niah_multikey", "needle", 1, 1, 1, tokenizer, length, seed, index)


@register_task("niah_multivalue")
def niah_multivalue(tokenizer, length: int, seed: int, index: int) -> Sample:
    """Four needles with the same key and different values in prose; all four values asked for."""
    return niah_sample("niah_multivalue", "prose", 1, 4, 1, tokenizer, length, seed, index)


@register_task("niah_multiquery")
def niah_multiquery(tokenizer, length: int, seed: int, index: int) -> Sample:
    """Four keys with one value each in prose; all four asked for at once."""
    return niah_sample("niah_multiquery", "prose", 4, 1, 4, tokenizer, length, seed, index)
