"""The evaluation harness on the tiny random Llama with a byte-level tokenizer and fake registered tasks."""

import csv
import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

import eval.harness as harness
from eval.harness import evaluate
from eval.inputs import length_bucket, read_tasks_file, split_specs
from eval.records import RECORD_FIELDS, TIMING_FIELDS, controller_digest
from eval.report import SUMMARY_COLUMNS
from eval.tasks.base import Sample, register_task, sample_seed

HEADER = ("controller,budget,task,length,n,accuracy,ci_low,ci_high,rel_accuracy,turn_accuracy,kl,bytes_read_per_token,"
          "bytes_moved_per_token,decode_ms_per_token,ttft_ms")


class ByteTokenizer:
    """One id per character (2..255); no chat template, so the harness uses the plain prompt."""

    eos_token_id = 1

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [2 + ord(c) % 254 for c in text]
        return SimpleNamespace(input_ids=torch.tensor(ids)[None] if return_tensors == "pt" else ids)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 2) for i in ids if i >= 2)

    def get_vocab(self):
        return {chr(i - 2): i for i in range(2, 256)}

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


WORDS = "the sky is blue and the grass is green so we go there and back again".split()


def _filler(rng: random.Random, chars: int) -> str:
    text = ""
    while len(text) < chars:
        text += " ".join(rng.choice(WORDS) for _ in range(8)) + ". "
    return text[:chars]


@register_task("fake_key")
def fake_key(tokenizer, length, seed, index):
    rng = random.Random(seed)
    key = str(rng.randint(0, 9))
    context = _filler(rng, length - 40)
    return Sample(task="fake_key", length=length, seed=seed, index=index,
                  input=f"{context} The key is {key}. What is the key?", answer_prefix=" The key is",
                  outputs=[key], metric="exact", max_new_tokens=6)


@register_task("fake_text")
def fake_text(tokenizer, length, seed, index):
    rng = random.Random(seed)
    return Sample(task="fake_text", length=length, seed=seed, index=index, input=_filler(rng, length),
                  answer_prefix="", outputs=[], metric="kl", continuation=_filler(rng, 12))


def fake_score(sample, text):
    """Deterministic, mixed 0/1 scores on random text (the tiny model never answers)."""
    return float(sum(map(ord, text)) % 2 == 0)


@pytest.fixture
def scored(monkeypatch):
    monkeypatch.setattr(harness, "score_sample", fake_score)


@pytest.fixture
def counted_runs(monkeypatch):
    from cache.runner import Runner

    calls = []
    original = Runner.run

    def run(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "run", run)
    return calls


def _evaluate(model, out, **kwargs):
    # the budget is a fraction of the context: blocks of 8 tokens leave room above the 2 pinned blocks at 64
    settings = dict(controllers=["lru", "oracle", "full"], budgets=[0.25, 0.5], tasks=["fake_key", "fake_text"],
                    lengths=[64, 128], n=2, seed=0, chat=False, progress=False, block_size=8)
    settings.update(kwargs)
    return evaluate(model, ByteTokenizer(), out_dir=out, **settings)


def _lines(path):
    return path.read_text().splitlines()


def _without_timings(path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in _lines(path)]


def _sorted_records(folder):
    return sorted(_without_timings(folder / "samples.jsonl"), key=lambda record: json.dumps(record, sort_keys=True))


def test_smoke_files_rows_and_rel_accuracy(tiny_model, tmp_path, scored):
    rows = _evaluate(tiny_model, tmp_path)
    for name in ("samples.jsonl", "summary.csv", "summary.md", "accuracy_vs_budget.png", "bytes_vs_context.png",
                 "eval_config.json"):
        assert (tmp_path / name).is_file(), name
    # 2 tasks × 2 lengths × 2 samples × (full + 2 controllers × 2 budgets)
    records = [json.loads(line) for line in _lines(tmp_path / "samples.jsonl")]
    assert len(records) == 2 * 2 * 2 * 5
    assert set(records[0]) == set(RECORD_FIELDS)
    with open(tmp_path / "summary.csv") as f:
        header = f.readline().strip()
        table = list(csv.DictReader([header, *f.read().splitlines()]))
    assert header == HEADER + ",full_cache_failed"
    assert tuple(header.split(",")) == SUMMARY_COLUMNS
    assert len(table) == len(rows) == 2 * 2 * (1 + 2 * 2)
    full = {(r["task"], r["length"]): r for r in table if r["controller"] == "full"}
    assert all(r["budget"] == "1" and r["n"] == "2" and float(r["kl"]) == 0.0 for r in full.values())
    for row in table:
        reference = float(full[(row["task"], row["length"])]["accuracy"])
        if reference == 0:
            assert row["rel_accuracy"] == "" and row["full_cache_failed"] == "1"
        else:
            assert float(row["rel_accuracy"]) == pytest.approx(float(row["accuracy"]) / reference, abs=1e-4)
            assert row["full_cache_failed"] == "0"
        group = [r for r in records if (r["controller"], r["task"], str(r["length"])) ==
                 (row["controller"], row["task"], row["length"]) and f"{r['budget']:g}" == row["budget"]]
        assert float(row["accuracy"]) == pytest.approx(sum(r["score"] for r in group) / len(group), abs=1e-4)
    # the controllers evicted: fewer bytes read than the full cache at the same task and length
    budgeted = [r for r in records if r["controller"] == "lru" and r["budget"] == 0.25]
    for record in budgeted:
        reference = next(r for r in records if r["controller"] == "full" and
                         (r["task"], r["length"], r["index"]) == (record["task"], record["length"], record["index"]))
        assert record["bytes_read_per_token"] < reference["bytes_read_per_token"]
        assert record["kl"] >= 0
    text = [r for r in records if r["task"] == "fake_text"]
    assert all(r["text"] is None and r["perplexity"] > 1 and r["new_tokens"] == 12 for r in text)
    assert all(r["kl"] > 0 for r in text if r["controller"] == "lru" and r["budget"] == 0.25)
    assert "| controller | budget | task |" in (tmp_path / "summary.md").read_text()


def test_resume_runs_nothing_new_and_determinism(tiny_model, tmp_path, scored, counted_runs):
    first, second = tmp_path / "a", tmp_path / "b"
    _evaluate(tiny_model, first, tasks=["fake_key"], lengths=[64], controllers=["lru"])
    runs = len(counted_runs)
    lines = _lines(first / "samples.jsonl")
    assert runs == len(lines) == 2 * (1 + 2)  # the full run is its own record: 2 samples × (full + 2 budgets)
    _evaluate(tiny_model, first, tasks=["fake_key"], lengths=[64], controllers=["lru"])
    assert len(counted_runs) == runs
    assert _lines(first / "samples.jsonl") == lines
    # a wider rerun runs only the new controller: the full cache's logits are read from references/
    assert sorted(p.name for p in (first / "references").iterdir()) == sorted(
        f"{json.loads(line)['sample_hash']}.pt" for line in lines if '"controller": "full"' in line)
    _evaluate(tiny_model, first, tasks=["fake_key"], lengths=[64], controllers=["lru", "h2o"])
    assert len(counted_runs) == runs + 2 * 2
    assert len(_lines(first / "samples.jsonl")) == len(lines) + 2 * 2
    # same seed, fresh folder: identical records apart from timings, the new controller's kl included (its
    # reference read back equals the one run afresh)
    _evaluate(tiny_model, second, tasks=["fake_key"], lengths=[64], controllers=["lru", "h2o"])
    assert _sorted_records(second) == _sorted_records(first)


def test_a_damaged_saved_reference_is_run_again_not_trusted(tiny_model, tmp_path, scored, counted_runs):
    """Negative control for the saved references: a file that cannot be read, or that holds another sample's
    logits, is ignored with a warning and the full cache runs again; the records are those of a clean folder."""
    clean, damaged = tmp_path / "clean", tmp_path / "damaged"
    for folder in (clean, damaged):
        _evaluate(tiny_model, folder, tasks=["fake_key"], lengths=[64], controllers=["lru"])
    _evaluate(tiny_model, clean, tasks=["fake_key"], lengths=[64], controllers=["lru", "h2o"])
    first, second = sorted((damaged / "references").iterdir())
    first.write_bytes(first.read_bytes()[:100])  # truncated
    second.write_bytes((clean / "references" / first.name).read_bytes())  # the other sample's logits
    runs = len(counted_runs)
    with pytest.warns(UserWarning, match="unreadable saved reference"):
        _evaluate(tiny_model, damaged, tasks=["fake_key"], lengths=[64], controllers=["lru", "h2o"])
    assert len(counted_runs) == runs + 2 * (1 + 2)  # both references ran again, beside h2o's runs at two budgets
    assert _sorted_records(damaged) == _sorted_records(clean)


def test_interrupted_last_line_is_dropped_and_rerun(tiny_model, tmp_path, scored):
    _evaluate(tiny_model, tmp_path, tasks=["fake_key"], lengths=[64], n=1, controllers=["lru"], plots=False)
    path = tmp_path / "samples.jsonl"
    complete = _without_timings(path)
    text = path.read_text()
    path.write_text(text[: len(text) - 20])  # cut the last record mid-line
    with pytest.warns(UserWarning, match="truncated last line"):
        _evaluate(tiny_model, tmp_path, tasks=["fake_key"], lengths=[64], n=1, controllers=["lru"], plots=False)
    assert _without_timings(path) == complete
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        _evaluate(tiny_model, tmp_path, tasks=["fake_key"], lengths=[64], n=1, controllers=["lru"], plots=False)


def test_records_reach_a_samples_file_replaced_during_the_run(tiny_model, tmp_path, scored, monkeypatch):
    """A results file replaced mid-run (a `git stash` / checkout does this: new inode, same name) still gets every
    later record; the harness once kept writing into the unlinked file and the records were lost."""
    path, record, calls = tmp_path / "samples.jsonl", harness._record, []

    def record_then_replace(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 and path.exists():  # after the first record: the file is swapped for a copy
            copy = tmp_path / "copy.jsonl"
            copy.write_text(path.read_text())
            os.replace(copy, path)
        return record(*args, **kwargs)

    monkeypatch.setattr(harness, "_record", record_then_replace)
    _evaluate(tiny_model, tmp_path, tasks=["fake_key"], lengths=[64], n=1, controllers=["lru"], plots=False)
    assert len(calls) == 3 and len(_lines(path)) == 3  # full + lru at two budgets, all in the file on disk


def test_seeds_are_stable_and_distinct():
    assert sample_seed(0, "passkey", 2048, 3) == sample_seed(0, "passkey", 2048, 3)
    seeds = {sample_seed(s, t, 2048, i) for s in (0, 1) for t in ("a", "b") for i in range(5)}
    assert len(seeds) == 2 * 2 * 5
    # the same sample at every length, so results pair across lengths
    assert sample_seed(0, "a", 64, 1) == sample_seed(0, "a", 128, 1)
    assert sample_seed(0, "passkey", 2048, 0) == 1077659594  # fixed forever: held-out seeds stay held out


def test_tasks_file_valid_and_malformed(tiny_model, tmp_path, scored):
    good = tmp_path / "mine.jsonl"
    entries = [{"input": "The code word is apple. " * 4 + "What is the code word?", "answer_prefix": " It is",
                "outputs": ["apple"], "metric": "string_match_all"},
               {"input": "Count: 1 2 3. " * 8 + "Next?", "outputs": ["4"], "metric": "exact", "max_new_tokens": 4}]
    good.write_text("\n".join(json.dumps(e) for e in entries) + "\n\n")
    parsed = read_tasks_file(good)
    assert [p["line"] for p in parsed] == [1, 2] and parsed[1]["answer_prefix"] == ""
    rows = evaluate(tiny_model, ByteTokenizer(), ["lru"], [0.5], None, None, 1, 0, tmp_path / "out",
                    tasks_file=good, chat=False, progress=False)
    records = [json.loads(line) for line in _lines(tmp_path / "out" / "samples.jsonl")]
    assert {r["task"] for r in records} == {"mine"} and len(records) == 2 * 2
    assert all(r["length"] == length_bucket(r["prompt_tokens"]) for r in records)
    assert {r["length"] for r in records} == {128}
    assert {(r["controller"], r["task"], r["length"], r["n"]) for r in rows} == {("full", "mine", 128, 2),
                                                                                 ("lru", "mine", 128, 2)}
    assert (tmp_path / "out" / "accuracy_vs_budget.png").is_file()
    # the same file gzip-compressed: the same samples and task name, so its records count as done
    import gzip

    packed = tmp_path / "packed" / "mine.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(good.read_bytes()))
    assert read_tasks_file(packed) == parsed
    again = evaluate(tiny_model, ByteTokenizer(), ["lru"], [0.5], None, None, 1, 0, tmp_path / "out",
                     tasks_file=packed, chat=False, progress=False)
    assert len(_lines(tmp_path / "out" / "samples.jsonl")) == len(records) and again == rows

    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps(entries[0]), json.dumps({"input": "x", "outputs": "apple", "metric": "exact"})]
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: 'outputs' must be a non-empty list"):
        read_tasks_file(bad)
    for broken, message in [("{oops", "not valid JSON"), ('["a"]', "expected a JSON object"),
                            ('{"input": "x", "outputs": ["a"]}', "missing key"),
                            ('{"input": "x", "outputs": ["a"], "metric": "bleu"}', "'metric' 'bleu'"),
                            ('{"input": "x", "output": ["a"], "outputs": ["a"], "metric": "exact"}', "unknown key")]:
        bad.write_text(json.dumps(entries[0]) + "\n" + broken + "\n")
        with pytest.raises(ValueError, match=f"line 2: .*{message}"):
            read_tasks_file(bad)


@pytest.mark.parametrize("kwargs, message", [
    ({"tasks": ["no_such_task"]}, r"--tasks: unknown task 'no_such_task': choose from .*fake_key"),
    ({"tasks": []}, "--tasks: the list is empty"),
    ({"controllers": ["nope"]}, r"unknown controller 'nope': choose from"),
    ({"controllers": []}, "--controllers: the list is empty"),
    ({"budgets": [0.5, 1.5]}, r"--budgets: 1.5 is outside \(0, 1\]"),
    ({"budgets": [0]}, r"--budgets: 0 is outside"),
    ({"budgets": []}, "--budgets: the list is empty"),
    ({"lengths": []}, "--lengths: the list is empty"),
    ({"lengths": [0]}, "--lengths: 0 must be a positive"),
    ({"lengths": [4096]}, "--lengths: 4096 tokens leave no room"),
    ({"n": 0}, "--n: .* positive integer"),
    ({"tasks": None}, "--tasks: give at least one task"),
])
def test_bad_inputs_name_the_flag(tiny_model, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _evaluate(tiny_model, tmp_path, **kwargs)
    assert not (tmp_path / "samples.jsonl").exists()


def test_changed_settings_are_refused(tiny_model, tmp_path, scored):
    _evaluate(tiny_model, tmp_path, tasks=["fake_key"], lengths=[64], n=1, controllers=["full"], plots=False)
    with pytest.raises(ValueError, match="other settings .*host_blocks"):
        _evaluate(tiny_model, tmp_path, tasks=["fake_key"], lengths=[64], n=1, controllers=["full"], host_blocks=4)


def test_controller_specs_keep_their_parameters():
    assert split_specs("lru,h2o:recent_tokens=128,heavy=0.5,full") == ["lru", "h2o:recent_tokens=128,heavy=0.5",
                                                                       "full"]


def test_real_scoring_is_used(tiny_model, tmp_path):
    _evaluate(tiny_model, tmp_path, tasks=["fake_key"], lengths=[64], n=1, controllers=["full"], plots=False)
    (record,) = [json.loads(line) for line in _lines(tmp_path / "samples.jsonl")]
    assert record["score"] in (0.0, 1.0)


def test_cli_eval_reports_errors_and_runs(tmp_path, capsys, monkeypatch, tiny_model, scored):
    from kvgym.cli import main

    code = main(["eval", "--budgets", "0.5,2", "--out", str(tmp_path)])
    assert code == 2 and "--budgets" in capsys.readouterr().err
    code = main(["eval", "--n", "0", "--out", str(tmp_path)])
    assert code == 2 and "--n" in capsys.readouterr().err
    code = main(["eval", "--tasks", "nope", "--out", str(tmp_path)])
    assert code == 2 and "unknown task 'nope'" in capsys.readouterr().err

    import cache.models

    monkeypatch.setattr(cache.models, "load_model",
                        lambda name, device="cpu", dtype=None: SimpleNamespace(model=tiny_model,
                                                                               tokenizer=ByteTokenizer(), name=name))
    code = main(["eval", "--model", "tiny", "--controllers", "lru,h2o:heavy_ratio=0.25,recent_ratio=0.25", "--budgets", "0.5",
                 "--tasks", "fake_key", "--lengths", "64", "--n", "1", "--no-chat", "--out", str(tmp_path / "cli")])
    assert code == 0, capsys.readouterr().err
    with open(tmp_path / "cli" / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["controller"] for r in table] == ["full", "lru", "h2o:heavy_ratio=0.25,recent_ratio=0.25"]


def test_paired_differences_pair_scores_by_sample(tmp_path, capsys):
    """Paired on the same samples: one that wins every sample is +1 with a degenerate interval; one that wins
    half and loses half is 0 with an interval around 0; samples one side never ran are left out."""
    from eval.report import paired_differences
    from kvgym.cli import main

    def record(controller, index, score, budget=0.25, task="passkey"):
        return {"controller": controller, "budget": budget, "task": task, "length": 1024, "index": index,
                "sample_hash": f"h{task}{index}", "score": score}

    wins = [i % 2 for i in range(20)]
    records = ([record("a", i, float(w)) for i, w in enumerate(wins)]
               + [record("b", i, float(1 - w)) for i, w in enumerate(wins)]
               + [record("b", i, 1.0, budget=0.5) for i in range(20)]  # a never ran 0.5: not compared
               + [record("c", i, 0.0) for i in range(5)])  # ran only 5 of the samples: paired on those 5
    rows = {row["other"]: row for row in paired_differences(records, "a")}
    assert set(rows) == {"b", "c"}
    assert rows["b"]["n"] == 20 and rows["b"]["difference"] == 0.0
    assert rows["b"]["wins"] == rows["b"]["losses"] == 10 and rows["b"]["ci_low"] < 0 < rows["b"]["ci_high"]
    assert rows["c"]["n"] == 5 and rows["c"]["difference"] == pytest.approx(sum(wins[:5]) / 5)
    aligned = [record("a", i, 1.0) for i in range(20)] + [record("b", i, 0.0) for i in range(20)]
    row = paired_differences(aligned, "a")[0]
    assert (row["difference"], row["ci_low"], row["ci_high"], row["wins"]) == (1.0, 1.0, 1.0, 20)
    with pytest.raises(ValueError, match="'z' is not in these results; they hold: a, b, c"):
        paired_differences(records, "z")
    samples = tmp_path / "samples.jsonl"
    samples.write_text("\n".join(json.dumps(r) for r in aligned))
    assert main(["compare", "--samples", str(samples), "--controller", "a", "--json", str(tmp_path / "p.json")]) == 0
    assert "+1.000 .. +1.000" in capsys.readouterr().out
    assert json.loads((tmp_path / "p.json").read_text())[0]["other"] == "b"
    assert main(["compare", "--samples", str(tmp_path / "missing.jsonl"), "--controller", "a"]) == 2
    assert "--samples" in capsys.readouterr().err


def test_report_summarises_every_record_of_a_folder(tmp_path, capsys):
    """Cells written by two eval commands are summarised together; a record written twice counts once; a
    folder without samples.jsonl is refused, naming it."""
    from kvgym.cli import main

    def record(controller, index, score, budget):
        return {"controller": controller, "budget": budget, "task": "passkey", "length": 1024, "index": index,
                "seed": 7, "sample_hash": f"h{index}", "score": score, "metric": "exact"}

    records = ([record("full", i, 1.0, 1.0) for i in range(4)] + [record("a", i, float(i < 2), 0.25) for i in range(4)]
               + [record("b", i, 0.0, 0.5) for i in range(4)] + [record("a", 0, 1.0, 0.25)])  # a rerun of one record
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    assert "3 rows from 12 records" in capsys.readouterr().out
    with open(tmp_path / "summary.csv") as f:
        table = {(r["controller"], r["budget"]): r for r in csv.DictReader(f)}
    assert set(table) == {("full", "1"), ("a", "0.25"), ("b", "0.5")}
    assert table[("a", "0.25")]["n"] == "4" and float(table[("a", "0.25")]["accuracy"]) == 0.5
    assert "b" in (tmp_path / "summary.md").read_text()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no samples.jsonl" in capsys.readouterr().err


def test_a_changed_policy_file_runs_again(tiny_model, tmp_path, scored, counted_runs, monkeypatch):
    """Records of a controller that names a file carry the file's digest; while it is unchanged a rerun does
    nothing, once it changes (a retrained policy) that controller's runs go again, with a warning."""
    policy = tmp_path / "policy.pt"
    policy.write_bytes(b"version 1")
    digest = controller_digest(f"ranker:{policy}")
    assert digest is not None and controller_digest(f"ranker:path={policy}") == digest
    assert controller_digest("lru") is None and controller_digest("h2o:heavy_ratio=0.25") is None
    policy.write_bytes(b"version 2")
    assert controller_digest(f"ranker:{policy}") != digest

    version = {"lru": "a"}
    monkeypatch.setattr(harness, "controller_digest", lambda spec: version.get(spec))
    out = tmp_path / "eval"
    _evaluate(tiny_model, out, tasks=["fake_key"], lengths=[64], controllers=["lru"])
    runs, lines = len(counted_runs), _lines(out / "samples.jsonl")
    rows = [json.loads(line) for line in lines]
    assert {r.get("controller_digest") for r in rows if r["controller"] == "lru"} == {"a"}
    assert all("controller_digest" not in r for r in rows if r["controller"] == "full")
    _evaluate(tiny_model, out, tasks=["fake_key"], lengths=[64], controllers=["lru"])
    assert len(counted_runs) == runs  # same file: nothing runs
    version["lru"] = "b"
    with pytest.warns(UserWarning, match="4 records of lru were made with another version"):
        _evaluate(tiny_model, out, tasks=["fake_key"], lengths=[64], controllers=["lru"])
    assert len(counted_runs) == runs + 2 * 2  # lru at both budgets again (the full cache's logits: references/)
    rows = [json.loads(line) for line in _lines(out / "samples.jsonl")]
    assert len(rows) == len(lines) + 4 and [r["controller_digest"] for r in rows[-4:]] == ["b"] * 4
    summary = (out / "summary.csv").read_text()
    assert summary.count("\nlru,") == 2  # reported once per budget, from the new records


def test_pooled_common_compares_only_the_samples_every_controller_ran():
    """A controller cut after 2 of 4 samples limits the budget's pooled table to those 2 (for the full cache and
    every controller alike); another budget keeps its own common set; scores pool over tasks, with Wilson
    intervals and accuracy relative to the full cache on the same samples. Negative control: pooled over all
    of each controller's samples instead, the cut controller's row would read differently from the others'."""
    from eval.report import pooled_common, wilson_interval

    def record(controller, task, index, score, budget, moved=0.0):
        return {"controller": controller, "budget": budget, "task": task, "length": 2048, "index": index,
                "sample_hash": f"{task}{index}", "score": score, "bytes_moved_per_token": moved}

    tasks = ("passkey", "niah")
    records = ([record("full", t, i, 1.0 if i < 3 else 0.0, 1.0) for t in tasks for i in range(4)]
               + [record("a", t, i, 1.0, 0.25, moved=2e6) for t in tasks for i in range(4)]
               + [record("b", t, i, 0.0 if t == "niah" else 1.0, 0.25) for t in tasks for i in range(2)]
               + [record("a", t, i, 0.0, 0.5) for t in tasks for i in range(4)])
    rows = pooled_common(records)
    at_quarter = {r["controller"]: r for r in rows if r["budget"] == 0.25}
    assert list(at_quarter) == ["full", "a", "b"]
    assert {r["n"] for r in at_quarter.values()} == {4}  # 2 tasks x the 2 samples b ran
    assert at_quarter["full"]["accuracy"] == 1.0 and at_quarter["a"]["accuracy"] == 1.0
    assert at_quarter["b"]["accuracy"] == 0.5 and at_quarter["b"]["rel_accuracy"] == 0.5
    assert (at_quarter["b"]["ci_low"], at_quarter["b"]["ci_high"]) == pytest.approx(wilson_interval(2, 4))
    assert at_quarter["a"]["bytes_moved_per_token"] == 2e6
    at_half = {r["controller"]: r for r in rows if r["budget"] == 0.5}
    assert at_half["full"]["n"] == 8 and at_half["full"]["accuracy"] == 0.75 and at_half["a"]["rel_accuracy"] == 0.0
    all_of_full = sum(r["score"] for r in records if r["controller"] == "full") / 8
    assert all_of_full != at_quarter["full"]["accuracy"]  # the cut is what makes the common set matter
