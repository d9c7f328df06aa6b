"""``kvgym train``: the ranking policy's whole pipeline from a config (``agents.ranker.pipeline``) on a tiny model,
and the training stage's resume after a kill (``agents.ranker.train``)."""

import json

import pytest
import torch

from agents.ranker.model import load_ranker
from agents.ranker.train import train
from agents.registry import make_controller
from kvgym.cli import main
from tests.test_ranking import synthetic_records

QUIET = {"log": lambda _: None}


def tiny_overrides(tmp_path, tiny):
    """The shipped config cut to a tiny random Llama (SmolLM2's tokenizer), passkey at 256 tokens."""
    return [f"runs_dir={tmp_path / 'runs'}", f"model={tiny}", "name=tiny",
            "collect.train=[{tasks: [passkey], lengths: [256], n: 2, seed: 1}]",
            "collect.validation=[{tasks: [passkey], lengths: [256], n: 1, seed: 2}]",
            "collect.drivers=[tova]", "collect.streaming_budgets=[0.5]", "collect.host_blocks=8",
            "train.warm_epochs=2", "train.rl_epochs=1", "train.budgets=[0.5]", "train.batch=8"]


def test_train_runs_the_pipeline_and_writes_a_policy_that_loads_as_a_controller(tmp_path, tiny_checkpoint, capsys):
    argv = ["train", "--config", "ranker_smollm2", *tiny_overrides(tmp_path, tiny_checkpoint)]
    assert main(argv) == 0, capsys.readouterr().err
    run = tmp_path / "runs" / "tiny"
    assert sorted(p.name for p in (run / "data" / "train").glob("*.pt")) == [
        "passkey_256_s1_0.pt", "passkey_256_s1_0_streaming_tova_b0.5_h8.pt",
        "passkey_256_s1_1.pt", "passkey_256_s1_1_streaming_tova_b0.5_h8.pt"]
    rows = [json.loads(line) for line in (run / "ranker" / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [0, 1, 2, 3]
    assert [row["stage"] for row in rows] == ["init", "warm", "warm", "policy_gradient"]
    scorer, summary = load_ranker(run / "policy.pt")
    assert summary["config"] == "tiny" and summary["from"].endswith("ranker.pt")
    assert make_controller(f"ranker:{run / 'policy.pt'}").stay == 0
    # the same folder again without --resume: refused, nothing rewritten
    before = (run / "policy.pt").stat().st_mtime_ns
    assert main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err and (run / "policy.pt").stat().st_mtime_ns == before
    # --resume of a finished run: nothing collected or trained again, the same policy
    files = {p: p.stat().st_mtime_ns for p in (run / "data").rglob("*.pt")}
    assert main([*argv, "--resume"]) == 0
    assert {p: p.stat().st_mtime_ns for p in (run / "data").rglob("*.pt")} == files
    again, _ = load_ranker(run / "policy.pt")
    assert all(torch.equal(a, b) for a, b in zip(scorer.state_dict().values(), again.state_dict().values(), strict=True))


class Killed(Exception):
    pass


def _kill_at(message_start):
    def log(message):
        if message.startswith(message_start):
            raise Killed(message)
    return log


def _weights(path):
    return load_ranker(path)[0].state_dict()


@pytest.mark.parametrize("kill_at", ["warm epoch 2", "policy_gradient epoch 4"])
def test_a_killed_training_run_resumes_to_the_weights_of_an_unbroken_one(tmp_path, kill_at):
    records, validation = synthetic_records(12, 0), synthetic_records(4, 1)
    settings = dict(warm_epochs=3, rl_epochs=2, samples=4, batch=32)
    train(records, validation, tmp_path / "whole", **settings, **QUIET)
    with pytest.raises(Killed):
        train(records, validation, tmp_path / "killed", **settings, log=_kill_at(kill_at))
    killed_state = torch.load(tmp_path / "killed" / "last.pt", weights_only=True)
    assert killed_state["epoch"] == int(kill_at.split()[-1]) - 1  # the epoch killed mid-way is not saved
    with pytest.raises(ValueError, match="--resume"):  # not overwritten without --resume
        train(records, validation, tmp_path / "killed", **settings, **QUIET)
    train(records, validation, tmp_path / "killed", **settings, resume=True, **QUIET)
    whole, resumed = (torch.load(tmp_path / name / "last.pt", weights_only=True) for name in ("whole", "killed"))
    assert resumed["epoch"] == whole["epoch"] == 5
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    assert resumed["best"] == whole["best"]
    rows = [json.loads(line)["epoch"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(6))  # one row per epoch: the one the kill interrupted is logged once, when rerun
    # negative control: the same resume with another random state (batch order, sampled rankings) ends elsewhere
    killed_state["rng"] = torch.Generator().manual_seed(123).get_state()
    (tmp_path / "control").mkdir()
    torch.save(killed_state, tmp_path / "control" / "last.pt")
    train(records, validation, tmp_path / "control", **settings, resume=True, **QUIET)
    control = torch.load(tmp_path / "control" / "last.pt", weights_only=True)
    assert any(not torch.equal(t, control["model"][n]) for n, t in whole["model"].items())


def test_resume_refuses_a_damaged_or_foreign_state(tmp_path):
    records, validation = synthetic_records(4, 0), synthetic_records(2, 1)
    with pytest.raises(ValueError, match="does not exist"):
        train(records, validation, tmp_path / "none", warm_epochs=1, rl_epochs=0, resume=True, **QUIET)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "last.pt").write_bytes(b"half a file")
    with pytest.raises(ValueError, match="cannot be read"):
        train(records, validation, tmp_path / "bad", warm_epochs=1, rl_epochs=0, resume=True, **QUIET)
    train(records, validation, tmp_path / "other", warm_epochs=1, rl_epochs=0, **QUIET)
    with pytest.raises(ValueError, match="that run has 1 epochs"):
        train(records, validation, tmp_path / "other", warm_epochs=2, rl_epochs=0, resume=True, **QUIET)
