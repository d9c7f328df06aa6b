"""The batched vector env on the tiny model: the same episodes as independent single envs (same seeds, same
actions) with fewer model calls; SB3 and Gymnasium vector APIs; a short MaskablePPO run on it."""

import gymnasium as gym
import numpy as np
import pytest

import kvgym  # noqa: F401  (registers the envs)
from kvgym.envs.vector import PagedKVCacheVecEnv, PagedKVCacheVectorEnv
from tests.conftest import make_tiny_llama
from tests.test_env import ByteTokenizer, make_env

KWARGS = dict(tasks=("toy_recall",), lengths=(160, 200), budget_range=(0.3, 0.6), num_candidates=8,
              prefill_chunk=32, decide_every=2)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


def random_actions(masks, rng):
    return np.stack([[rng.choice(np.flatnonzero(slot)) for slot in mask.reshape(-1, 4)] for mask in masks])


def compare_with_single_envs(model, n: int, steps: int) -> dict:
    """Step a batched vector env and n single envs (same seeds, same random legal actions); returns the largest
    reward and observation differences, the resets seen and the vector env's model calls."""
    vec = PagedKVCacheVecEnv(n, model=model, tokenizer=ByteTokenizer(), **KWARGS)
    singles = [make_env(model=model) for _ in range(n)]
    vec.seed(11)
    observations = vec.reset()
    single_obs = [env.reset(seed=11 + i)[0] for i, env in enumerate(singles)]
    rng = np.random.default_rng(0)
    worst = {"reward": 0.0, "observation": 0.0, "done_mismatch": 0, "resets": 0}

    def compare_obs(vector_obs, single):
        for key in single:
            worst["observation"] = max(worst["observation"], float(np.abs(vector_obs[key] - single[key]).max()))

    for _ in range(steps):
        for i in range(n):
            compare_obs({key: value[i] for key, value in observations.items()}, single_obs[i])
        actions = random_actions(vec.action_masks(), rng)
        vec.step_async(actions)
        observations, rewards, dones, infos = vec.step_wait()
        for i, env in enumerate(singles):
            obs, reward, terminated, _, info = env.step(actions[i])
            worst["reward"] = max(worst["reward"], abs(reward - float(rewards[i])))
            worst["done_mismatch"] += int(dones[i] != terminated)
            if terminated:
                if dones[i]:
                    compare_obs(infos[i]["terminal_observation"], obs)
                obs, _ = env.reset()  # continues the env's RNG, as the vector env's autoreset does
                worst["resets"] += 1
            single_obs[i] = obs
    worst["model_calls"] = vec.model_calls
    vec.close()
    return worst


def test_batched_episodes_equal_independent_single_envs(model):
    n, steps = 3, 40
    result = compare_with_single_envs(model, n, steps)
    assert result["reward"] < 1e-3 and result["observation"] < 1e-4 and result["done_mismatch"] == 0, result
    assert result["resets"] >= 2
    # the rows shared forwards: fewer model calls than one per env and step (each step is >= 1 forward per env)
    assert result["model_calls"] < steps * n


def test_rows_wired_to_the_wrong_caches_fail_the_comparison(model, monkeypatch):
    """Negative control: a vector env whose batched forward hands row i another row's cache must fail the
    comparison above."""
    import kvgym.envs.vector as vector

    right = vector.batched_forward

    def rotated(model_, caches, input_ids, logits_to_keep=1):
        return right(model_, caches[1:] + caches[:1], input_ids, logits_to_keep)

    monkeypatch.setattr(vector, "batched_forward", rotated)
    result = compare_with_single_envs(model, 3, 12)
    assert result["reward"] > 1e-3 or result["observation"] > 1e-3, result


def test_sb3_checks_and_maskable_ppo_runs(model):
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    from agents.ppo.policy import SlotScorerPolicy

    vec = VecNormalize(VecMonitor(PagedKVCacheVecEnv(2, model=model, tokenizer=ByteTokenizer(), **KWARGS)),
                       norm_obs_keys=["layer_pressure", "globals"])
    agent = MaskablePPO(SlotScorerPolicy, vec, n_steps=16, batch_size=32, n_epochs=1, policy_kwargs={"hidden": 8},
                        seed=0, device="cpu")
    agent.learn(32)
    assert agent.num_timesteps == 32
    masks = vec.env_method("action_masks")
    assert len(masks) == 2 and masks[0].shape == (8 * 4,) and masks[0].reshape(8, 4)[:, 0].all()


def test_gymnasium_make_vec_uses_the_batched_env(model):
    envs = gym.make_vec("kvgym/PagedKVCache-v0", num_envs=2, vectorization_mode="vector_entry_point",
                        model=model, tokenizer=ByteTokenizer(), **KWARGS)
    assert isinstance(envs.unwrapped, PagedKVCacheVectorEnv)
    observations, infos = envs.reset(seed=3)
    assert observations["blocks"].shape == (2, 8 * 12)
    rng = np.random.default_rng(1)
    finished = 0
    for _ in range(60):
        observations, rewards, terminated, truncated, infos = envs.step(random_actions(envs.unwrapped.action_masks(),
                                                                                        rng))
        assert rewards.shape == (2,) and np.isfinite(rewards).all()
        if terminated.any():
            finished += int(terminated.sum())
            assert "final_obs" in infos and infos["_final_obs"][terminated].all()
    assert finished >= 1
    envs.close()


def test_bench_env_tiny_writes_rates(tmp_path):
    """``kvgym bench env --model none``: the tiny model's single and batched live rates (SmolLM2's tokenizer)."""
    from kvgym.cli import main

    path = tmp_path / "env.json"
    assert main(["bench", "env", "--model", "none", "--num-envs", "2", "--live-steps", "2", "--json", str(path)]) == 0
    import json

    rows = json.loads(path.read_text())["rows"]
    assert [(r["mode"], r["num_envs"]) for r in rows] == [("live", 1), ("live_batched", 2)]
    assert all(r["steps_per_s"] > 0 and r["steps"] >= 2 for r in rows)
