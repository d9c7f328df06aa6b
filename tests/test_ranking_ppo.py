"""PPO (stable-baselines3) of the ranking policy on ``RankingReplayEnv``: its Gaussian over keep scores, that it
learns (and fails with the reward's sign flipped), its zip file (loaded by ``load_ranker`` and SB3 alike,
damage refused), resuming a killed run, and the zip as a cache controller."""

import json
import zipfile

import numpy as np
import pytest
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv

from agents.ranker.controller import RankerController
from agents.ranker.model import PPO_ENTRY, BlockScorer, PolicyFileError, load_ranker, save_ranker
from agents.ranker.ppo import SCORE_BOUND, RankingPolicy, train_ppo
from agents.ranker.train import regret_table
from agents.registry import make_controller
from cache.ranking import RANK_FEATURES
from kvgym.envs.decisions import Decisions, RankingReplayEnv
from tests.test_ranking import synthetic_records

QUIET = {"log": lambda _: None}


def _ppo(env_class=RankingReplayEnv, seed: int = 0, lr: float = 3e-4) -> tuple[PPO, Decisions]:
    decisions = Decisions(synthetic_records(20, 0))
    envs = DummyVecEnv([lambda: env_class(decisions, score_bound=SCORE_BOUND) for _ in range(4)])
    model = PPO(RankingPolicy, envs, n_steps=128, batch_size=128, n_epochs=4, learning_rate=lr, gamma=0.0, seed=seed,
                device="cpu")
    model.policy.scorer.set_normalisation(decisions.features[decisions.candidates])
    return model, decisions


def test_log_probability_is_the_gaussian_over_the_candidates_only():
    model, decisions = _ppo()
    policy = model.policy
    with torch.no_grad():
        policy.log_std.fill_(-0.7)
    obs = {"blocks": decisions.features[:5], "candidates": decisions.candidates[:5].float()}
    obs["candidates"][:, 3] = 0.0  # a pinned block: its score decides nothing
    with torch.no_grad():
        actions, values, log_prob = policy(obs)
        mean = policy.scorer(obs["blocks"])[0]
        want = torch.distributions.Normal(mean, np.exp(-0.7)).log_prob(actions)
        want = (want * obs["candidates"]).sum(dim=-1)
        assert values.shape == (5, 1) and torch.allclose(log_prob, want, atol=1e-4)
        moved = actions.clone()
        moved[:, 3] += 5.0
        assert torch.allclose(policy.evaluate_actions(obs, moved)[1], log_prob, atol=1e-4)
        moved[:, 4] += 5.0  # a candidate's score does change it (control)
        assert not torch.allclose(policy.evaluate_actions(obs, moved)[1], log_prob, atol=1e-2)
        entropy = policy.evaluate_actions(obs, actions)[2]
        want = (torch.distributions.Normal(mean, np.exp(-0.7)).entropy() * obs["candidates"]).sum(dim=-1)
        assert torch.allclose(entropy, want, atol=1e-4)
        assert torch.equal(policy._predict(obs, deterministic=True), mean)


class _RewardFlipped(RankingReplayEnv):
    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, -reward, terminated, truncated, info


def _validation_regret(model: PPO) -> float:
    with torch.no_grad():
        return regret_table(Decisions(synthetic_records(6, 1)), model.policy.scorer)["ranker"]["all"]


def test_ppo_learns_the_ranking_from_scratch_and_not_with_the_reward_flipped():
    model, _ = _ppo()
    start = _validation_regret(model)
    model.learn(8192)
    learned = _validation_regret(model)
    flipped, _ = _ppo(_RewardFlipped)
    flipped.learn(8192)
    assert learned < 0.5 * start, (start, learned)
    assert _validation_regret(flipped) > start, (start, _validation_regret(flipped))  # negative control


def test_train_ppo_writes_a_zip_that_loads_as_a_ranker_and_as_sb3_and_resumes(tmp_path):
    records, validation = synthetic_records(12, 0), synthetic_records(4, 1)
    start = save_ranker(BlockScorer(), tmp_path / "start.pt")
    out = tmp_path / "run"
    train_ppo(records, validation, out, timesteps=2048, start=start, envs=4, n_steps=128, batch=128,
              eval_every=1024, **QUIET)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["timesteps"] for r in rows] == [0, 1024, 2048]
    assert rows[0]["validation_regret"] == pytest.approx(
        regret_table(Decisions(validation), load_ranker(start)[0])["ranker"]["all"], abs=1e-6)  # the start, scored
    assert any((out / "tensorboard").rglob("events.*"))
    # killed here: the rerun with --resume continues last.zip to the new total
    summary = train_ppo(records, validation, out, timesteps=3072, start=start, envs=4, n_steps=128, batch=128,
                        eval_every=1024, resume=True, **QUIET)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["timesteps"] for r in rows] == [0, 1024, 2048, 3072]
    best = min(rows, key=lambda r: r["validation_regret"])
    assert summary["best"]["timesteps"] == best["timesteps"]

    scorer, saved = load_ranker(out / "ppo.zip")
    assert saved["best"]["regret"] == pytest.approx(best["validation_regret"])
    features = Decisions(validation).features[:3]
    with torch.no_grad():
        assert torch.allclose(scorer(features)[0], load_ranker(out / "ranker.pt")[0](features)[0], atol=1e-6)
    # the same zip through SB3 itself: its deterministic action is the scorer's keep scores
    sb3 = PPO.load(out / "ppo.zip", device="cpu")
    observation = {"blocks": features[0].numpy(), "candidates": Decisions(validation).candidates[0].float().numpy()}
    with torch.no_grad():
        assert np.allclose(sb3.predict(observation, deterministic=True)[0], scorer(features[0])[0].numpy(), atol=1e-5)


def test_a_damaged_or_foreign_zip_is_refused(tmp_path):
    model, _ = _ppo()
    from agents.ranker.ppo import save_ppo_ranker

    path = save_ppo_ranker(model, tmp_path / "p.zip", {"note": "test"})
    assert load_ranker(path)[1] == {"note": "test"}
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}

    def rewrite(name: str, change) -> object:
        target = tmp_path / name
        with zipfile.ZipFile(target, "w") as archive:
            for entry, data in change(dict(entries)).items():
                archive.writestr(entry, data)
        return target

    def tamper(files):
        weights = bytearray(files["policy.pth"])
        weights[-30] ^= 0xFF
        return {**files, "policy.pth": bytes(weights)}

    with pytest.raises(PolicyFileError, match="sha256"):
        load_ranker(rewrite("tampered.zip", tamper))
    with pytest.raises(PolicyFileError, match="not a kvgym ranking policy"):  # an SB3 zip without the entry
        load_ranker(rewrite("foreign.zip", lambda files: {k: v for k, v in files.items() if k != PPO_ENTRY}))
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(PolicyFileError):
        load_ranker(truncated)


def test_the_zip_is_a_cache_controller(tmp_path):
    model, _ = _ppo()
    from agents.ranker.ppo import save_ppo_ranker

    path = save_ppo_ranker(model, tmp_path / "p.zip")
    controller = make_controller(f"ranker:{path}")
    assert isinstance(controller, RankerController)
    features = np.random.default_rng(0).normal(size=(2, 10, model.policy.scorer.num_features)).astype(np.float32)
    with torch.no_grad():
        want = model.policy.scorer(torch.from_numpy(features))[0].numpy()
    assert np.allclose(controller._model(features)[0], want, atol=1e-5)


def test_replay_env_checks_its_score_bound():
    decisions = Decisions(synthetic_records(2, 0))
    assert RankingReplayEnv(decisions, score_bound=SCORE_BOUND).action_space.high.max() == pytest.approx(SCORE_BOUND)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="score_bound"):
            RankingReplayEnv(decisions, score_bound=bad)


def _one_by_one_regrets(decisions: Decisions, actions: np.ndarray, rows: list[int]) -> list[float]:
    """Each env's regret computed alone, row by row (the reference the batched env is checked against)."""
    return [float(decisions.regret(torch.from_numpy(actions[i : i + 1]), slice(r, r + 1))[0]) for i, r in enumerate(rows)]


def test_grouped_envs_show_one_decision_and_pay_each_ranking_against_the_others():
    from agents.ranker.ppo import make_envs

    decisions = Decisions(synthetic_records(20, 0))
    envs = make_envs(decisions, count=6, seed=0, group=3)
    observations = envs.reset()
    blocks = observations["blocks"]
    assert np.array_equal(blocks[0], blocks[1]) and np.array_equal(blocks[1], blocks[2])
    assert np.array_equal(blocks[3], blocks[5]) and not np.array_equal(blocks[0], blocks[3])
    rows = envs.venv.rows.tolist()
    actions = np.random.default_rng(0).normal(size=(6, blocks.shape[1])).astype(np.float32)
    regret = np.array(_one_by_one_regrets(decisions, actions, rows))
    following, rewards, dones, infos = envs.step(actions)
    assert dones.all() and [info["regret"] for info in infos] == pytest.approx(regret, abs=1e-6)
    for start in (0, 3):
        own = -regret[start : start + 3]
        want = own - (own.sum() - own) / 2  # leave-one-out
        assert rewards[start : start + 3] == pytest.approx(want, abs=1e-6)
    assert np.array_equal(following["blocks"][0], following["blocks"][2])  # the next decision is shared too
    with pytest.raises(ValueError, match="group"):
        make_envs(decisions, count=6, seed=0, group=4)


def test_ppo_with_group_relative_rewards_learns_from_scratch(tmp_path):
    records, validation = synthetic_records(20, 0), synthetic_records(6, 1)
    summary = train_ppo(records, validation, tmp_path, timesteps=8192, envs=8, group=4, n_steps=64, batch=128,
                        lr=3e-4, eval_every=8192, **QUIET)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["validation_regret"] < 0.5 * rows[0]["validation_regret"], rows
    assert summary["group"] == 4


def test_the_shipped_ppo_ranker_loads_as_a_ranker_and_with_sb3():
    """``policies/ppo_smollm2.zip``: the ranking policy trained with PPO (grouped, from the 30-epoch warm start);
    its summary records a validation regret below the start's (0.0658), and SB3 reads the same scorer."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "policies" / "ppo_smollm2.zip"
    scorer, summary = load_ranker(path)
    assert summary["group"] == 8 and summary["start"].endswith("warm_start.pt")
    assert summary["best"]["regret"] < 0.0658
    controller = make_controller(f"ranker:{path},stay=2")
    assert isinstance(controller, RankerController) and controller.stay == 2
    sb3 = PPO.load(path, device="cpu")  # trained before the window-vote features: SB3 reads its own feature set
    width, own = sb3.observation_space["blocks"].shape
    names = json.loads(zipfile.ZipFile(path).read("kvgym_ranker.json"))["features"]
    assert own == len(names) < scorer.num_features == len(RANK_FEATURES)
    blocks = np.random.default_rng(0).normal(size=(width, own)).astype(np.float32)
    observation = {"blocks": blocks, "candidates": np.ones(width, np.float32)}
    lifted = np.zeros((width, len(RANK_FEATURES)), np.float32)
    lifted[:, [RANK_FEATURES.index(name) for name in names]] = blocks
    with torch.no_grad():
        want = scorer(torch.from_numpy(lifted))[0].numpy()
    assert np.allclose(sb3.predict(observation, deterministic=True)[0], want, atol=1e-4)


def test_a_fixed_std_stays_where_it_started_and_a_learned_one_moves(tmp_path):
    records, validation = synthetic_records(8, 0), synthetic_records(3, 1)
    logs = {}
    for learn in (True, False):
        train_ppo(records, validation, tmp_path / str(learn), timesteps=1024, envs=4, n_steps=128, batch=128,
                  log_std_init=-0.5, learn_std=learn, eval_every=1024, **QUIET)
        rows = [json.loads(line) for line in (tmp_path / str(learn) / "metrics.jsonl").read_text().splitlines()]
        logs[learn] = rows[-1]["log_std"]
    assert logs[False] == pytest.approx(-0.5) and logs[True] != pytest.approx(-0.5, abs=1e-4)


def test_the_batched_vec_env_pays_each_env_its_own_regret_and_checks_actions():
    from agents.ranker.ppo import RankingReplayVecEnv

    decisions = Decisions(synthetic_records(20, 0))
    envs = RankingReplayVecEnv(decisions, 5, score_bound=SCORE_BOUND, seed=1)
    observations = envs.reset()
    rows = envs.rows.tolist()
    assert len(set(rows)) > 1  # group 1: each env draws its own decision
    for i, row in enumerate(rows):
        assert np.array_equal(observations["blocks"][i], decisions.features[row].numpy())
        assert np.array_equal(observations["candidates"][i], decisions.candidates[row].float().numpy())
    actions = np.random.default_rng(0).normal(size=(5, observations["blocks"].shape[1])).astype(np.float32)
    _, rewards, dones, infos = envs.step(actions)
    single = _one_by_one_regrets(decisions, actions, rows)
    assert dones.all() and rewards == pytest.approx([-r for r in single], abs=1e-6)
    assert [info["row"] for info in infos] == rows
    assert np.array_equal(infos[2]["terminal_observation"]["blocks"], observations["blocks"][2])
    with pytest.raises(ValueError, match="finite keep scores"):
        envs.step(actions[:, :-1])
    with pytest.raises(ValueError, match="finite keep scores"):
        envs.step(np.full_like(actions, np.nan))
    with pytest.raises(ValueError, match="group"):
        RankingReplayVecEnv(decisions, 5, group=2)
    with pytest.raises(ValueError, match="at least one env"):
        RankingReplayVecEnv(decisions, 0)
    with pytest.raises(RuntimeError, match="before reset"):
        RankingReplayVecEnv(decisions, 5, score_bound=SCORE_BOUND).step(actions)


def test_train_ppo_refuses_a_minibatch_larger_than_its_rollout(tmp_path):
    with pytest.raises(ValueError, match="batch: expected a minibatch of 2 to 512"):
        train_ppo(synthetic_records(4, 0), synthetic_records(2, 1), tmp_path, envs=8, n_steps=64, batch=1024, **QUIET)
