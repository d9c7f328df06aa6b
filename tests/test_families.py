"""The retrieval families (eval/tasks/families.py) and their generalization split, on the real SmolLM2 tokenizer.

Every family's samples fit their length, state each needle once, and the gold follows from the text (through the
link in two-hop samples). The split is checked on the text itself: no wording, opening line or filler of the
training side appears in a held-out sample and none of the held-out side in a training one; the negative control
(a sample's own wording) is found, so the check can fail.
"""

from __future__ import annotations

import re

import pytest

from eval.tasks import generate
from eval.tasks.common import NOISE_SENTENCES, count_tokens
from eval.tasks.families import FAMILY_TASKS, FILLERS, OPENINGS, SPLITS, VARIANTS, WORDINGS, families


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from cache.models import ensure_smollm2

    return AutoTokenizer.from_pretrained(str(ensure_smollm2()))


@pytest.fixture(scope="module")
def samples(tokenizer):
    """Every family of both sides once at 1k (the first len(families) indexes cycle through them)."""
    return {split: [generate(FAMILY_TASKS[split], tokenizer, 1024, seed=0, index=i) for i in range(len(families(split)))]
            for split in SPLITS}


def template_pattern(template: str) -> re.Pattern:
    """A template as a pattern: its fixed text, each placeholder any text within a line."""
    pieces = re.split(r"\{\w+\}", template)
    return re.compile(r"[^\n]+?".join(re.escape(piece) for piece in pieces))


def wording_marks(wording: str) -> list[re.Pattern]:
    w = WORDINGS[wording]
    return [template_pattern(template) for template in (w.needle, w.question, w.link)]


def test_the_split_is_disjoint_in_every_part():
    train, validation, heldout = SPLITS["train"], SPLITS["validation"], SPLITS["heldout"]
    for a, b in (("train", "heldout"), ("train", "validation"), ("validation", "heldout")):
        assert not set(SPLITS[a]["wordings"]) & set(SPLITS[b]["wordings"]), (a, b)
        assert not set(SPLITS[a]["fillers"]) & set(SPLITS[b]["fillers"]), (a, b)
        assert not set(OPENINGS[a]) & set(OPENINGS[b]), (a, b)
    assert set(train["wordings"]) | set(validation["wordings"]) | set(heldout["wordings"]) == set(WORDINGS)
    assert set(train["fillers"]) | set(validation["fillers"]) | set(heldout["fillers"]) == set(FILLERS)
    assert len(families("heldout")) == len(heldout["wordings"]) * len(heldout["fillers"]) * len(heldout["variants"])
    assert set(train["variants"]) == set(VARIANTS) == set(heldout["variants"]) | set(SPLITS["heldout_hard"]["variants"])
    assert {k: v for k, v in SPLITS["heldout_hard"].items() if k != "variants"} == \
        {k: v for k, v in heldout.items() if k != "variants"}
    with pytest.raises(ValueError, match="family split 'test'"):
        families("test")


def test_each_sample_index_cycles_through_every_family(samples):
    for split, drawn in samples.items():
        assert {s.meta["family"] for s in drawn} == {"/".join(f) for f in families(split)}
        assert all(s.meta["split"] == split and s.task == FAMILY_TASKS[split] for s in drawn)


def test_no_text_of_one_side_occurs_in_the_other(samples):
    pairs = [(a, b) for a in SPLITS for b in ("train", "validation", "heldout") if a != b and {a, b} != {"heldout", "heldout_hard"}]
    for split, other in pairs:
        foreign = [mark for w in SPLITS[other]["wordings"] for mark in wording_marks(w)]
        foreign += [re.compile(re.escape(line)) for line in OPENINGS[other] if line]
        for sample in samples[split]:
            text = sample.prompt
            assert not [mark.pattern for mark in foreign if mark.search(text)], sample.meta["family"]
            own = wording_marks(sample.meta["wording"])  # the negative control: its own wording is there
            assert all(mark.search(text) for mark in own[:2]), sample.meta["family"]
    for sample in samples["heldout"] + samples["heldout_hard"] + samples["validation"]:  # no training filler
        assert not any(sentence in sample.context for sentence in NOISE_SENTENCES)
        assert '{"id": ' not in sample.context and "Alice" not in sample.context
    for sample in samples["train"] + samples["heldout"]:  # no validation filler: no stock-table row, no chat line
        assert "| id | item |" not in sample.context and not re.search(r"^\[\d\d:\d\d\] \w+: ", sample.context, re.M)
    for sample in samples["validation"]:  # and no essay or Python source (a def or an import line)
        assert not re.search(r"^(def |import |from \w+ import )", sample.context, re.M)


@pytest.mark.parametrize("length", [1024, 4096])
def test_length_needles_and_gold(tokenizer, length):
    for split in SPLITS:
        for index in range(0, len(families(split)), 5 if length > 1024 else 1):
            sample = generate(FAMILY_TASKS[split], tokenizer, length, seed=3, index=index)
            assert abs(count_tokens(tokenizer, sample.prompt) - length) <= 0.02 * length, sample.meta["family"]
            meta = sample.meta
            for needle in meta["needles"]:
                assert sample.context.count(needle) == 1, (meta["family"], needle)
            asked = meta["keys"][0]
            assert asked in sample.question and asked in sample.answer_prefix
            (gold,) = sample.outputs
            holder = meta["keys"][1] if meta["variant"] == "twohop" else asked
            # the gold is stated once, in the needle of the key that holds it
            stating = [n for n in meta["needles"] if gold.lower() in n.lower()]  # scored case-insensitively
            assert len(stating) == 1 and holder in stating[0], meta["family"]
            if meta["variant"] == "twohop":  # the link sends the asked key to the holder
                link = meta["needles"][0]
                assert asked in link and holder in link and gold.lower() not in link.lower()


def test_samples_are_reproducible(tokenizer):
    a = generate("families_heldout", tokenizer, 1024, seed=5, index=7)
    b = generate("families_heldout", tokenizer, 1024, seed=5, index=7)
    c = generate("families_heldout", tokenizer, 1024, seed=6, index=7)
    assert a.input == b.input and a.outputs == b.outputs
    assert a.input != c.input
