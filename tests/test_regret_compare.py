"""Rankings compared on held-out decision points (`eval.regret_compare`, `python -m benchmarks.ranker_tools regret`): the fraction
of a reference's gap to the oracle closed, resampled by whole samples."""

import json

import pytest
import torch

from agents.ranker.model import BlockScorer, save_ranker
from benchmarks.ranker_tools import main
from cache.ranking import RANK_FEATURES
from eval.regret_compare import compare_rankings, comparison_md, gap_closed
from kvgym.envs.decisions import BUDGETS, Decisions
from tests.test_ranking import synthetic_records

SIGNAL = RANK_FEATURES.index("last_mean_log_share")


def numbered_records(count: int, seed: int) -> list[dict]:
    return [{**record, "task": "passkey", "length": 2048, "seed": seed, "index": i}
            for i, record in enumerate(synthetic_records(count, seed))]


def test_decisions_number_samples_and_a_streaming_state_shares_its_samples_number():
    records = numbered_records(3, 0)
    records.append({**records[1], "budgets": [0.25], "phase": "question"})  # sample 1 again, another state
    decisions = Decisions(records)
    per_record = 2 * len(BUDGETS)  # 2 layers x every budget
    assert decisions.sample[:3 * per_record].tolist() == [i for i in range(3) for _ in range(per_record)]
    assert decisions.sample[3 * per_record:].tolist() == [1, 1]


def test_gap_closed_is_one_for_the_oracle_zero_for_the_reference_and_negative_for_a_worse_ranking():
    decisions = Decisions(numbered_records(8, 1))
    reference = decisions.features[..., SIGNAL]  # the noisy signal: some regret, less than random
    oracle = gap_closed(decisions, decisions.mass, reference, boot=500)
    assert oracle["gap_closed"] == pytest.approx(1.0) and oracle["ci_low"] == pytest.approx(1.0)
    assert oracle["samples"] == 8 and oracle["worse"] == 0
    itself = gap_closed(decisions, reference, reference, boot=500)
    assert itself["gap_closed"] == 0.0 and itself["better"] == itself["worse"] == 0
    reverse = gap_closed(decisions, -decisions.mass, reference, boot=500)  # negative control: the anti-oracle
    assert reverse["gap_closed"] < 0 and reverse["ci_high"] < 0 and reverse["worse"] == 8
    halfway = gap_closed(decisions, reference + 0.5 * decisions.mass.clamp(min=1e-6).log(), reference, boot=500)
    assert halfway["ci_low"] <= halfway["gap_closed"] <= halfway["ci_high"]
    with pytest.raises(ValueError, match="oracle"):
        gap_closed(decisions, reference, decisions.mass)


def test_compare_rankings_tables_every_ranking_and_checks_its_reference():
    decisions = Decisions(numbered_records(4, 2))
    rankings = {"signal": decisions.features[..., SIGNAL], "oracle": decisions.mass}
    report = compare_rankings(decisions, rankings, "signal")
    assert report["regret"]["oracle"]["all"] == 0.0
    assert report["regret"]["signal"]["all"] > 0
    assert set(report["regret"]["signal"]) >= {str(b) for b in BUDGETS} | {"compress", "all"}
    assert list(report["against_reference"]) == ["oracle"]
    text = comparison_md(report)
    assert "| oracle | +100.0% |" in text
    with pytest.raises(ValueError, match="reference 'nobody'"):
        compare_rankings(decisions, rankings, "nobody")


def test_ranker_regret_command_scores_ranker_files_on_held_out_records(tmp_path, capsys):
    folder = tmp_path / "test"
    folder.mkdir()
    for i, record in enumerate(numbered_records(3, 5)):
        torch.save(record, folder / f"passkey_2048_s5_{i}.pt")
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        model = BlockScorer(len(RANK_FEATURES), 8)
        model.set_normalisation(torch.randn(50, len(RANK_FEATURES)))
        save_ranker(model, tmp_path / f"{name}.pt")
    out = tmp_path / "report.json"
    assert main(["regret", "--records", str(folder), "--policies",
                 f"a={tmp_path / 'a.pt'},b={tmp_path / 'b.pt'}", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["reference"] == "a" and report["samples"] == 3
    assert {"a", "b", "key_norm (Knorm)"} <= set(report["regret"])
    assert "| b |" in capsys.readouterr().out
    assert main(["regret", "--records", str(folder), "--policies", str(tmp_path / "a.pt")]) != 0
    assert "expected NAME=PATH pairs" in capsys.readouterr().err
    assert main(["regret", "--records", str(tmp_path / "nothing"),
                 "--policies", f"a={tmp_path / 'a.pt'}"]) != 0
    assert "no decision points" in capsys.readouterr().err


def test_live_kl_comparison_pairs_the_points_of_each_sample():
    from eval.regret_compare import live_kl_comparison

    samples = ["a", "a", "b", "b", "c", "c"]  # two budgets per sample
    kls = {"start": [0.4, 0.2, 0.3, 0.1, 0.5, 0.5], "trained": [0.2, 0.2, 0.1, 0.1, 0.6, 0.5]}
    report = live_kl_comparison(kls, samples, "start")
    row = report["against_reference"]["trained"]
    assert report["samples"] == 3 and report["points"] == 6
    assert report["mean_kl"]["trained"] == pytest.approx(1.7 / 6)
    assert row["difference"] == pytest.approx((-0.2 - 0.2 + 0.1) / 6)
    assert (row["better"], row["worse"]) == (2, 1)
    assert row["ci_low"] <= row["difference"] <= row["ci_high"] and row["ci_low"] < 0 < row["ci_high"]
    same = live_kl_comparison({"x": kls["start"], "y": kls["start"]}, samples, "x")["against_reference"]["y"]
    assert same["difference"] == same["ci_low"] == same["ci_high"] == 0  # a ranking against itself
    with pytest.raises(ValueError, match="reference"):
        live_kl_comparison(kls, samples, "missing")
    with pytest.raises(ValueError, match="one KL per"):
        live_kl_comparison({"start": [0.1]}, samples, "start")
