"""The task generators (eval/tasks) and the scorers (eval/tasks/scoring.py), on the real SmolLM2 tokenizer.

Only the tokenizer is loaded (no weights). For every task at 1024 and 4096 tokens (and 8192 for a few):
the prompt's length is within 2% of the target, every needle is present exactly once and the gold answer
can be derived from the text by following it; samples are reproducible from (seed, index).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from eval.tasks import TASKS, generate
from eval.tasks.base import Sample
from eval.tasks.common import DATA_DIR, count_tokens, prose_text, word_list
from eval.tasks.scoring import score, string_match_all, string_match_part

ALL_TASKS = ["passkey", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "fwe",
             "research", "text"]
CASES = [(task, length) for task in ALL_TASKS for length in (1024, 4096)]
CASES += [("niah_multikey", 8192), ("research", 8192), ("text", 8192), ("text_long", 2048)]

NEEDLE_RE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")
FACT_RE = re.compile(r"\b([A-Z][a-z]+) reports to ([A-Z][a-z]+)\.")
VAR_RE = re.compile(r"^VAR ([A-Z]+) = (?:VAR ([A-Z]+)|(\d+))$")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from cache.models import ensure_smollm2

    return AutoTokenizer.from_pretrained(str(ensure_smollm2()))


@pytest.fixture(scope="module")
def make(tokenizer):
    cache: dict[tuple, Sample] = {}

    def get(task: str, length: int, seed: int = 0, index: int = 0) -> Sample:
        key = (task, length, seed, index)
        if key not in cache:
            cache[key] = generate(task, tokenizer, length, seed, index)
        return cache[key]

    return get


def test_every_task_is_registered():
    assert set(ALL_TASKS) <= set(TASKS)


@pytest.mark.parametrize("task,length", CASES)
def test_prompt_length_is_within_two_percent(make, tokenizer, task, length):
    sample = make(task, length)
    n = count_tokens(tokenizer, sample.prompt)
    assert abs(n - length) <= 0.02 * length, (task, length, n)
    assert (sample.task, sample.length, sample.seed, sample.index) == (task, length, 0, 0)
    assert json.loads(json.dumps(sample.to_dict())) == sample.to_dict()  # a JSON-lines record as is


# ------------------------------------------------------------------------------ answer derivable per task

def check_passkey(sample: Sample):
    key = sample.outputs[0]
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    assert sample.prompt.count(needle) == 1
    assert sample.prompt.count(key) == 2  # only inside the needle
    assert sample.metric == "exact" and sample.prompt.endswith("What is the pass key? The pass key is")


def needles_of(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key, value in NEEDLE_RE.findall(text):
        found.setdefault(key, []).append(value)
    return found


def check_niah(sample: Sample, expect_needles: int | None, queried: int, values_per_key: int):
    found = needles_of(sample.input)
    question = re.search(r"special magic numbers? for (.+) mentioned in the provided text\?$", sample.input)
    assert question, sample.input[-300:]
    keys = re.split(r", and |, | and ", question.group(1))
    assert len(keys) == queried and set(keys) <= set(found)
    gold = [value for key in keys for value in found[key]]
    assert sorted(gold) == sorted(sample.outputs) and len(gold) == queried * values_per_key
    for key in keys:  # each needle of a queried key exactly once
        for value in found[key]:
            needle = f"One of the special magic numbers for {key} is: {value}."
            assert sample.input.count(needle) == 1
            assert sample.input.count(value) == 1
    if expect_needles is not None:
        assert sum(len(v) for v in found.values()) == expect_needles
    assert sample.metric == "string_match_all"
    assert sample.answer_prefix.startswith(" The special magic number")
    assert sample.answer_prefix.rstrip().endswith("is" if len(gold) == 1 else "are")


def check_niah_single(sample: Sample):
    check_niah(sample, 1, 1, 1)
    lines = sample.input.split("\n")[1:-1]  # context lines between the instruction and the question
    assert sum(1 for line in lines if line.startswith("The grass is green.")) == len(lines) - 1


def check_niah_multikey(sample: Sample):
    check_niah(sample, None, 1, 1)
    lines = sample.input.split("\n")[1:-1]
    assert len(lines) > 20 and all(NEEDLE_RE.fullmatch(line) for line in lines)  # a haystack of needles
    assert len(needles_of(sample.input)) == len(lines)  # all keys distinct


def check_prose(sample: Sample):
    context = sample.input.split("\n", 1)[1].rsplit("\n", 1)[0]
    stripped = FACT_RE.sub("", NEEDLE_RE.sub("", context))
    words = stripped.split()
    prose_words = set(prose_text().split())
    assert sum(w in prose_words for w in words) / len(words) > 0.99  # the haystack is Alice


def check_niah_multivalue(sample: Sample):
    check_niah(sample, 4, 1, 4)
    check_prose(sample)


def check_niah_multiquery(sample: Sample):
    check_niah(sample, 4, 4, 1)
    check_prose(sample)


def check_vt(sample: Sample):
    value = re.findall(r"assigned the value (\d+) in the text above\.", sample.input)[-1]
    assert f"assigned the value {value}, they are:" in sample.answer_prefix
    assignments: dict[str, str] = {}
    order: dict[str, int] = {}
    for number, line in enumerate(sample.input.split("\n")):
        match = VAR_RE.match(line)
        if match:
            name, source, literal = match.groups()
            assert name not in assignments  # each statement exactly once
            assignments[name] = literal if literal else source
            order[name] = number

    def resolve(name: str) -> str:
        target = assignments[name]
        return target if target.isdigit() else resolve(target)

    holders = {name for name in assignments if resolve(name) == value}
    assert holders == set(sample.outputs) and len(holders) == 5
    for name in holders:  # in order: a variable is assigned before it is used
        source = assignments[name]
        if not source.isdigit():
            assert order[source] < order[name]
        assert sample.input.count(f"VAR {name} =") == 1
    example_names = set(assignments) - holders
    assert len(example_names) == 5 and all(len(n) == 3 for n in example_names)


def check_fwe(sample: Sample):
    context = sample.input.split("coded words. ", 1)[1].split("\nQuestion:", 1)[0]
    counts = Counter(context.split())
    ranked = counts.most_common()
    assert ranked[0][0] == "..."
    top = [word for word, _ in ranked[1:4]]
    assert set(top) == set(sample.outputs)
    assert ranked[3][1] > ranked[4][1]  # no tie at the cut


def check_research(sample: Sample):
    facts = FACT_RE.findall(sample.input)
    reports_to = dict(facts)
    assert len(reports_to) == len(facts) == 8
    for a, b in facts:
        assert sample.input.count(f"{a} reports to {b}.") == 1
    start = re.search(r"Who is at the top of (\w+)'s reporting chain\?", sample.input).group(1)
    person, hops = start, 0
    while person in reports_to:
        person, hops = reports_to[person], hops + 1
    assert hops == 4 and [person] == sample.outputs
    tops = set(reports_to.values()) - set(reports_to)
    assert len(tops) == 2  # the distractor chain has its own top
    assert sample.answer_prefix == f" Answer: The person at the top of {start}'s reporting chain is"
    check_prose(sample)


def check_text(sample: Sample, tokenizer=None):
    assert sample.metric == "kl" and sample.outputs == [] and sample.answer_prefix == ""
    assert sample.continuation and sample.continuation[0].isspace()
    assert (sample.input + sample.continuation) in prose_text()
    start = prose_text().index(sample.input + sample.continuation)
    assert start == 0 or prose_text()[start - 1] == "\n"  # starts at a paragraph
    want = 1024 if sample.task == "text_long" else 64  # the long-generation twin decodes ~1,024 tokens
    assert abs(sample.meta["continuation_tokens"] - want) <= want // 8 and sample.max_new_tokens == sample.meta[
        "continuation_tokens"]


CHECKS = {"passkey": check_passkey, "niah_single": check_niah_single, "niah_multikey": check_niah_multikey,
          "niah_multivalue": check_niah_multivalue, "niah_multiquery": check_niah_multiquery, "vt": check_vt,
          "fwe": check_fwe, "research": check_research, "text": check_text, "text_long": check_text}


@pytest.mark.parametrize("task,length", CASES)
def test_needles_once_and_answer_derivable(make, task, length):
    CHECKS[task](make(task, length))


@pytest.mark.parametrize("task", ALL_TASKS)
def test_gold_answer_scores_one_and_nonsense_zero(make, task):
    sample = make(task, 1024)
    if sample.metric == "kl":
        with pytest.raises(ValueError, match="kl"):
            score(sample, "anything")
        return
    assert score(sample, " " + ", ".join(sample.outputs) + ".") == 1.0
    assert score(sample, " I do not know.") == 0.0
    assert score(sample.to_dict(), " " + " ".join(sample.outputs)) == 1.0  # a tasks-file row works too


@pytest.mark.parametrize("task", ALL_TASKS)
def test_same_seed_same_sample_other_seed_other_sample(make, tokenizer, task):
    first = make(task, 1024, seed=3, index=1)
    again = generate(task, tokenizer, 1024, 3, 1)
    assert again.to_dict() == first.to_dict()
    other_seed = make(task, 1024, seed=4, index=1)
    other_index = make(task, 1024, seed=3, index=2)
    for other in (other_seed, other_index):
        assert other.input != first.input
        if first.outputs:
            assert other.outputs != first.outputs


def test_needles_are_kept_across_lengths(make):
    """Everything random is drawn before the length search: a longer prompt asks the same question."""
    for task in ("niah_multivalue", "research", "vt", "passkey"):
        assert make(task, 1024).outputs == make(task, 4096).outputs


def test_too_short_length_is_refused(tokenizer):
    with pytest.raises(ValueError):
        generate("vt", tokenizer, 100, 0, 0)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        generate("nope", tokenizer, 1024, 0, 0)


def test_old_passkey_interface_still_works(tokenizer):
    from eval.tasks.passkey import passkey_sample, score_passkey

    sample = passkey_sample(tokenizer, 2000, seed=0, depth=0.5)
    assert f"The pass key is {sample.answer}." in sample.prompt
    # unchanged on purpose (other tests use it): whole filler lines, a few lines short of the target
    assert 0.9 * 2000 <= count_tokens(tokenizer, sample.prompt) <= 2000
    assert score_passkey(f" {sample.answer}.", sample.answer) and not score_passkey(" 1.", sample.answer)


def test_shipped_word_lists():
    for name in ("adjectives", "nouns", "names"):
        words = word_list(name)
        assert len(words) >= 100 and len(set(words)) == len(words)
        lowered = [w.lower() for w in words]
        assert not [w for w in lowered if any(w != o and w in o for o in lowered)]  # no substrings
        assert (DATA_DIR / f"{name}.txt").stat().st_size < 100_000
    alice = prose_text().lower()
    assert not [n for n in word_list("names") if n.lower() in alice]


# ---------------------------------------------------------------------------------------------- scorers

def make_sample(outputs, metric) -> Sample:
    return Sample(task="t", length=0, seed=0, index=0, input="q", answer_prefix="", outputs=outputs,
                  metric=metric)


def test_string_match_all_gives_partial_credit_and_part_gives_any():
    gold = ["1234567", "7654321", "ROYAL", "fancy"]
    full = "Numbers 1234567 and 7654321; words royal, Fancy."
    half = "1234567 and royal"
    assert score(make_sample(gold, "string_match_all"), full) == 1.0
    assert score(make_sample(gold, "string_match_all"), half) == 0.5
    assert score(make_sample(gold, "string_match_all"), "1111111") == 0.0
    assert score(make_sample(gold, "string_match_part"), half) == 1.0
    assert score(make_sample(gold, "string_match_part"), "7654321") == 1.0
    assert score(make_sample(gold, "string_match_part"), "nothing here") == 0.0
    assert string_match_all("\x00royal\x1f", ["royal"]) == 1.0  # control characters become newlines
    assert string_match_part("x", ["a", "x"]) == 1.0


def test_exact_is_the_first_integer():
    sample = make_sample(["14745"], "exact")
    assert score(sample, " 14745. Remember it.") == 1.0
    assert score(sample, "The pass key is 14745") == 1.0
    assert score(sample, " 14746") == 0.0  # wrong answer
    assert score(sample, " 147450") == 0.0
    assert score(sample, " 12 then 14745") == 0.0
    assert score(sample, " no digits") == 0.0


def test_kl_and_unknown_metrics_are_refused():
    with pytest.raises(ValueError, match="harness"):
        score(make_sample([], "kl"), "text")
    with pytest.raises(ValueError, match="metric"):
        score({"task": "x", "metric": "bleu", "outputs": ["a"]}, "a")
    with pytest.raises(ValueError):
        score(make_sample([], "string_match_all"), "a")


# ------------------------------------------------------------------------------ parts and multi-turn tasks

@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey", "vt", "fwe", "research"])
def test_samples_know_their_context_and_question(make, task):
    sample = make(task, 1024)
    assert sample.input == sample.context + sample.question and sample.question.strip()
    assert "?" in sample.question or sample.question.startswith("Question:")
    for gold in sample.outputs:  # the answer is in the context, never only in the question
        assert gold in sample.context or task == "fwe"


@pytest.mark.parametrize("task", ["mt_niah", "mt_kv", "mt_passkey", "mt_niah5", "mt_kv5", "mt_passkey5"])
@pytest.mark.parametrize("length", [1024, 4096])
def test_multiturn_tasks(make, tokenizer, task, length):
    from eval.tasks.multiturn import LONG_TURNS, NUM_TURNS

    if task.endswith("5"):
        NUM_TURNS = LONG_TURNS  # noqa: N806  (the five-turn twins)
    sample = make(task, length)
    n = count_tokens(tokenizer, sample.prompt)
    assert abs(n - length) <= 0.02 * length, (task, length, n)
    assert len(sample.turns) == NUM_TURNS - 1
    golds = [outputs[0] for outputs in sample.all_outputs]
    assert len(set(golds)) == NUM_TURNS  # every turn asks something else
    for gold in golds:  # a pass key is stated twice in its needle ("K is the red pass key")
        assert sample.context.count(gold) == (2 if task.startswith("mt_passkey") else 1), (task, gold)
    questions = [sample.question] + [turn.question for turn in sample.turns]
    assert len(set(questions)) == NUM_TURNS and all(q.strip() for q in questions)
    assert all(turn.question.startswith("\n") for turn in sample.turns)
    assert make(task, length) is make(task, length) and generate(task, tokenizer, length, 0, 0).turns == sample.turns


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey", "vt"])
def test_answer_positions_are_the_context_tokens_that_state_the_answer(make, tokenizer, task, chat):
    from eval.tasks.prompt import answer_positions, build_prompt

    sample = make(task, 1024)
    prompt = build_prompt(tokenizer, sample, chat)
    positions = answer_positions(tokenizer, sample, chat)
    assert positions and all(0 < p < prompt.context_end for p in positions)  # in the context, never the question
    stated = tokenizer.decode([prompt.ids[p] for p in positions]).replace(" ", "")
    for gold in sample.outputs:  # every gold answer is spelled out by those tokens, as often as the context says it
        assert stated.count(gold) >= sample.context.count(gold) >= 1
    # negative control: the same count of tokens elsewhere in the context does not spell the answer
    elsewhere = tokenizer.decode(prompt.ids[prompt.context_end - 2 * len(positions): prompt.context_end - len(positions)])
    assert not all(gold in elsewhere.replace(" ", "") for gold in sample.outputs)
