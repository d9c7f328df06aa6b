"""Variable tracking (RULER ``vt``: `scripts/data/synthetic/variable_tracking.py`, `baselines.md` §6.3).

One chain (num_chains=1) of four hops (num_hops=4) over five variables of five random capital letters:
"VAR QWERT = 52817", "VAR ASDFG = VAR QWERT", ... each statement on its own line, in chain order, at
seed-drawn depths among the noise lines ("The grass is green. ..."; the last line may be partial).
A one-shot example comes first, built the same way with three-letter variables, its own random value and
20 noise sentences (RULER's example is up to 500 tokens and starts from 12345 before randomising; ours is
~200 tokens to leave room at 1k), followed by its answer. Prompt:

    Memorize and track the chain(s) of variable assignment hidden in the following text.

    {context}
    Question: Find all variables that are assigned the value {value} in the text above.

answer prefix " Answer: According to the chain(s) of variable assignment in the text above, 5 variables
are assigned the value {value}, they are:" (RULER's ends with a space, dropped here so that the model
writes the space itself, as in the example). Gold: the five variable names; ``string_match_all``;
30 new tokens.
"""

from __future__ import annotations

import random
import string

from eval.tasks.base import Sample, register_task
from eval.tasks.common import depth_position, fit_length, interleave, last_line, make_rng, noise_lines

TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                 "variables are assigned the value {query}, they are:")
NUM_HOPS = 4
EXAMPLE_NOISE_SENTENCES = 20
MAX_NEW_TOKENS = 30


def make_chain(rng: random.Random, num_hops: int, name_len: int, value: int,
               avoid: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(variables, statements) of one chain: ``VAR v0 = value``, ``VAR v{j+1} = VAR v{j}``. No variable
    is a substring of another or of one in ``avoid`` (and vice versa)."""
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if all(name not in other and other not in name for other in names + list(avoid)):
            names.append(name)
    statements = [f"VAR {names[0]} = {value}"]
    statements += [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(num_hops)]
    return names, statements


def chain_context(n_sentences: int, statements: list[str], fractions: list[float]) -> str:
    """Noise lines with the variable-assignment statements inserted at the given depths."""
    lines = noise_lines(n_sentences)
    positions = [depth_position(f, len(lines)) for f in fractions]
    return "\n".join(interleave(lines, list(zip(positions, statements, strict=True))))


@register_task("vt")
def vt(tokenizer, length: int, seed: int, index: int) -> Sample:
    """Variable tracking with one chain of four hops and a one-shot example (see the module docstring)."""
    rng = make_rng("vt", seed, index)
    value = rng.randint(10000, 99999)
    names, statements = make_chain(rng, NUM_HOPS, 5, value)
    fractions = sorted(rng.random() for _ in statements)
    example_value = rng.randint(10000, 99999)
    while example_value == value:
        example_value = rng.randint(10000, 99999)
    example_names, example_statements = make_chain(rng, NUM_HOPS, 3, example_value, avoid=tuple(names))
    example_fractions = sorted(rng.random() for _ in example_statements)
    example = (TEMPLATE.format(context=chain_context(EXAMPLE_NOISE_SENTENCES, example_statements,
                                                     example_fractions), query=example_value)
               + ANSWER_PREFIX.format(num_v=NUM_HOPS + 1, query=example_value)
               + " " + " ".join(example_names))
    answer_prefix = ANSWER_PREFIX.format(num_v=NUM_HOPS + 1, query=value)

    def build(n: int) -> str:
        return example + "\n\n" + TEMPLATE.format(context=chain_context(n, statements, fractions), query=value)

    n, text = fit_length(tokenizer, length, build, lambda t: t + answer_prefix, 0, 4 * length, what="vt")
    return Sample(task="vt", length=length, seed=seed, index=index, input=text, question=last_line(text), answer_prefix=answer_prefix,
                  outputs=list(names), metric="string_match_all", max_new_tokens=MAX_NEW_TOKENS,
                  meta={"value": value, "statements": statements, "example_names": example_names,
                        "example_value": example_value, "noise_sentences": n})
