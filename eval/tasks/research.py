"""A multi-step "research" task: follow a reporting chain whose links are scattered over a long document.

Facts of the form "{A} reports to {B}." are hidden between the sentences of *Alice's Adventures in
Wonderland* (``eval/data/alice29.txt``, from a seed-chosen paragraph): the asked chain
``P0 -> P1 -> P2 -> P3 -> P4`` (four facts, ``NUM_HOPS``) and a distractor chain of four facts over five
other people, so that "the one person who reports to nobody" is not enough -- the answer needs every link
of P0's chain, in order, while the facts appear in shuffled order at distinct depths drawn from RULER's
40 depths. Names come from ``eval/data/names.txt`` (none occurs in the Alice text). Prompt:

    Some facts about who reports to whom are hidden within the following text. Make sure to memorize
    them. I will ask you to follow a chain of them afterwards.
    {context}
    Question: Who is at the top of {P0}'s reporting chain? Follow it from {P0}: the person {P0} reports
    to, the person that person reports to, and so on, until someone who reports to nobody.

answer prefix " Answer: The person at the top of {P0}'s reporting chain is". Gold: ``[P4]``; metric
``string_match_all`` (a single gold string); 32 new tokens. ``meta`` holds both chains.
"""

from __future__ import annotations

from eval.tasks.base import Sample, register_task
from eval.tasks.common import (
    DEPTHS,
    fit_length,
    insert_into_prose,
    last_line,
    make_rng,
    prose_parts,
    prose_window,
    word_list,
)

TEMPLATE = ("Some facts about who reports to whom are hidden within the following text. Make sure to memorize "
            "them. I will ask you to follow a chain of them afterwards.\n{context}\n"
            "Question: Who is at the top of {start}'s reporting chain? Follow it from {start}: the person "
            "{start} reports to, the person that person reports to, and so on, until someone who reports "
            "to nobody.")
ANSWER_PREFIX = " Answer: The person at the top of {start}'s reporting chain is"
FACT = "{a} reports to {b}."
NUM_HOPS = 4
NUM_DISTRACTOR_CHAINS = 1
MAX_NEW_TOKENS = 32


@register_task("research")
def research(tokenizer, length: int, seed: int, index: int) -> Sample:
    """Top of a reporting chain of NUM_HOPS facts scattered through prose (see the module docstring)."""
    rng = make_rng("research", seed, index)
    people = rng.sample(word_list("names"), (NUM_HOPS + 1) * (1 + NUM_DISTRACTOR_CHAINS))
    chains = [people[i:i + NUM_HOPS + 1] for i in range(0, len(people), NUM_HOPS + 1)]
    facts = [FACT.format(a=chain[j], b=chain[j + 1]) for chain in chains for j in range(NUM_HOPS)]
    rng.shuffle(facts)
    depths = [d / 100 for d in rng.sample(DEPTHS, len(facts))]
    start_word = rng.choice(prose_parts()[2])
    start, top = chains[0][0], chains[0][-1]
    answer_prefix = ANSWER_PREFIX.format(start=start)

    def build(n: int) -> str:
        context = insert_into_prose(prose_window(start_word, n), list(zip(depths, facts, strict=True)))
        return TEMPLATE.format(context=context, start=start)

    n, text = fit_length(tokenizer, length, build, lambda t: t + answer_prefix, 0, 4 * length,
                         what="research")
    return Sample(task="research", length=length, seed=seed, index=index, input=text, question=last_line(text),
                  answer_prefix=answer_prefix, outputs=[top], metric="string_match_all",
                  max_new_tokens=MAX_NEW_TOKENS,
                  meta={"chain": chains[0], "distractor_chains": chains[1:], "facts": facts, "depths": depths,
                        "prose_start_word": start_word, "prose_words": n})
