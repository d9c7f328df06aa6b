"""The harness under each protocol, data sets through ``datasets`` and multi-turn samples (tiny random Llama)."""

import json
import math
import random

import pytest

import eval.harness as harness
import eval.inputs as inputs
from eval.datasets import load_samples
from eval.harness import evaluate
from eval.tasks.base import Sample, Turn, register_task
from tests.test_harness import ByteTokenizer, _filler, fake_score


@register_task("fake_turns")
def fake_turns(tokenizer, length, seed, index):
    rng = random.Random(seed)
    keys = [str(rng.randint(0, 9)) for _ in range(3)]
    context = _filler(rng, length - 40) + "".join(f" Key {i} is {k}." for i, k in enumerate(keys))
    return Sample.from_parts(task="fake_turns", length=length, seed=seed, index=index, context=context,
                             question=" What is key 0?", answer_prefix=" Key 0 is", outputs=[keys[0]], metric="exact",
                             max_new_tokens=4, turns=[Turn("\nWhat is key 1?", [keys[1]], " Key 1 is"),
                                                      Turn("\nWhat is key 2?", [keys[2]], " Key 2 is")])


def run(model, out, **kwargs):
    settings = dict(controllers=["lru", "h2o"], budgets=[0.5], tasks=["fake_key"], lengths=[96], n=2, seed=0,
                    chat=False, progress=False, plots=False, block_size=8)
    settings.update(kwargs)
    return evaluate(model, ByteTokenizer(), out_dir=out, **settings)


def records(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("protocol", ["streaming", "oneshot", "oneshot-question"])
def test_each_protocol_runs_and_is_recorded(tiny_model, tmp_path, protocol):
    run(tiny_model, tmp_path, protocol=protocol)
    config = json.loads((tmp_path / "eval_config.json").read_text())
    assert config["protocol"] == protocol and config["decode_budget"] == "grow"
    rows = records(tmp_path)
    assert len(rows) == 2 * 3 and {r["protocol"] for r in rows} == {protocol}
    for row in rows:  # the budget is a fraction of the context
        if row["controller"] != "full":
            assert row["budget_blocks"] == math.ceil(0.5 * row["context_tokens"] / 8)
            assert row["context_tokens"] < row["prompt_tokens"]
    with pytest.raises(ValueError, match="other settings"):  # another protocol into the same folder
        run(tiny_model, tmp_path, protocol="multiturn" if protocol != "multiturn" else "streaming")


def test_shared_prefills_give_the_same_records(tiny_model, tmp_path):
    for share in (True, False):
        run(tiny_model, tmp_path / str(share), protocol="oneshot-question", share_prefill=share)
    strip = ("decode_ms_per_token", "ttft_ms")
    a, b = ([{k: v for k, v in r.items() if k not in strip} for r in records(tmp_path / str(s))] for s in (True, False))
    assert a == b


@pytest.mark.parametrize("protocol,tasks", [("oneshot-question", ["fake_key"]), ("streaming", ["fake_key", "fake_text"]),
                                            ("multiturn", ["fake_turns"])])
def test_batched_runs_give_the_same_records(tiny_model, tmp_path, protocol, tasks):
    """``batch_runs``: a sample's runs in lockstep, forwards batched: the records of runs one at a time (times aside,
    KL and perplexity to float rounding)."""
    for batch in (True, False):
        run(tiny_model, tmp_path / str(batch), protocol=protocol, tasks=tasks, batch_runs=batch,
            controllers=["lru", "h2o", "tova"], budgets=[0.25, 0.5])
    strip = ("decode_ms_per_token", "ttft_ms", "kl", "perplexity")
    batched, alone = ([{k: v for k, v in r.items() if k not in strip} for r in records(tmp_path / str(b))]
                      for b in (True, False))
    assert batched == alone and len(alone) == len(tasks) * 2 * (1 + 3 * 2)
    for a, b in zip(records(tmp_path / "True"), records(tmp_path / "False"), strict=True):
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-5) and a["perplexity"] == pytest.approx(b["perplexity"])


@pytest.mark.parametrize("protocol", ["multiturn", "oneshot"])
def test_multiturn_scores_every_turn(tiny_model, tmp_path, monkeypatch, protocol):
    monkeypatch.setattr(harness, "score_sample", fake_score)
    rows = run(tiny_model, tmp_path, tasks=["fake_turns"], protocol=protocol, budgets=[0.5])
    recs = records(tmp_path)
    assert all(len(r["turn_scores"]) == 3 and len(r["text"]) == 3 for r in recs)
    assert all(abs(r["score"] - sum(r["turn_scores"]) / 3) < 1e-9 for r in recs)
    assert all(len(row["turn_accuracy"].split("/")) == 3 for row in rows)
    with pytest.raises(ValueError, match="use --protocol multiturn"):
        run(tiny_model, tmp_path / "single", tasks=None, dataset=str(write_scbench(tmp_path)), protocol="streaming")


def test_a_controller_that_cannot_run_the_protocol_is_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="oracle cannot run under --protocol oneshot"):
        run(tiny_model, tmp_path, controllers=["oracle"], protocol="oneshot")


def write_kvpress(tmp_path, rows=None):
    path = tmp_path / "ruler_like.jsonl"
    rows = rows or [{"context": "The sky is blue. " * 6 + "The key is 7.", "question": " What is the key?",
                     "answer_prefix": " The key is", "answers": ["7"], "max_new_tokens": 4, "task": "key"},
                    {"context": "Grass is green. " * 6 + "The code is 3.", "question": " What is the code?",
                     "answer_prefix": " The code is", "answer": "3", "max_new_tokens": 4, "task": "code"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_scbench(tmp_path, turns=None):
    path = tmp_path / "scbench_kv.jsonl"
    turns = [{"input": "Key a?", "answer": "1"}, {"input": "Key b?", "answer": "2"}] if turns is None else turns
    path.write_text(json.dumps({"context": "a is 1. b is 2. " * 8, "multi_turns": turns}) + "\n")
    return path


def test_datasets_in_the_kvpress_and_scbench_schemas(tmp_path):
    samples = load_samples(str(write_kvpress(tmp_path)))
    assert [s.task for s in samples] == ["key", "code"] and samples[1].outputs == ["3"]
    assert samples[0].context.endswith("The key is 7.") and samples[0].question == " What is the key?"
    assert samples[0].input == samples[0].context + samples[0].question and samples[0].max_new_tokens == 4
    (turns,) = load_samples(str(write_scbench(tmp_path)))
    assert turns.outputs == ["1"] and [t.outputs for t in turns.turns] == [["2"]]
    assert turns.question == "\nKey a?" and turns.turns[0].question == "\nKey b?"


@pytest.mark.parametrize("make, message", [
    (lambda p: write_kvpress(p, [{"context": "x", "answers": ["1"]}]), "needs 'context' and 'question'"),
    (lambda p: write_kvpress(p, [{"context": "x", "question": "y"}]), "needs an 'answers' or 'answer' column"),
    (lambda p: write_scbench(p, turns=[]), "'multi_turns' has no turns"),
    (lambda p: write_kvpress(p, [{"context": "x", "question": "y", "answers": []}]), "'answers' / 'answer'"),
    (lambda p: p / "missing_folder", "could not be read"),
])
def test_bad_datasets_are_named(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        load_samples(str(make(tmp_path)))


def test_dataset_samples_run_through_the_harness(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "score_sample", fake_score)
    run(tiny_model, tmp_path / "out", tasks=None, dataset=str(write_kvpress(tmp_path)), protocol="oneshot-question",
        budgets=[0.5], block_size=4)
    assert {r["task"] for r in records(tmp_path / "out")} == {"key", "code"}


def test_tasks_file_accepts_context_and_question(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"context": "abc ", "question": "what?", "outputs": ["x"], "metric": "exact"}) + "\n"
                    + json.dumps({"input": "abc what?", "question": "what?", "outputs": ["y"], "metric": "exact"}) + "\n")
    entries = inputs.read_tasks_file(path)
    assert [e["input"] for e in entries] == ["abc what?", "abc what?"] and entries[0]["question"] == "what?"
    path.write_text(json.dumps({"context": "a", "question": "b", "input": "c", "outputs": ["x"], "metric": "exact"}))
    with pytest.raises(ValueError, match="must equal 'context' \\+ 'question'"):
        inputs.read_tasks_file(path)


def test_bench_eval_times_every_setting_and_compares_their_answers(tiny_model):
    from eval.benchmark import bench_eval

    report = bench_eval(tiny_model, ByteTokenizer(), controllers="lru,h2o", budgets="0.5", tasks="fake_key",
                        lengths="96", n=1)
    assert [name for name in ("per_run", "shared", "shared_batched") if report[name]["runs"] == 3] == [
        "per_run", "shared", "shared_batched"]
    assert report["same_answers"] == {"per_run": True, "shared": True, "shared_batched": True}
    assert set(report["speedup_over_per_run"]) == {"per_run", "shared", "shared_batched"}
    streaming = bench_eval(tiny_model, ByteTokenizer(), controllers="lru", budgets="0.5", tasks="fake_key",
                           lengths="96", n=1, protocol="streaming")
    assert "per_run" not in streaming and set(streaming["same_answers"]) == {"shared", "shared_batched"}
