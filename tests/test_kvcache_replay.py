"""``kvgym/KVCacheReplay-v1`` on the tiny random Llama: the replay of a recorded full-cache run steps the live
env's decision points with the live env's rule, so a policy whose scores depend on the block alone leaves the same
tiers and moves the same bytes in both; the checkers; the reward's parts; bad input."""

import gymnasium as gym
import numpy as np
import pytest
import torch

import kvgym  # noqa: F401  (registers the envs)
from cache.tiers import Tier
from kvgym.envs.kvcache_replay import TIER_COLUMNS, KVCacheReplayEnv, record_episode
from tests.test_harness import ByteTokenizer
from tests.test_harness_protocols import fake_turns  # noqa: F401  (registers fake_turns)
from tests.test_kvcache_env import make
from tests.toy import toy_recall  # noqa: F401  (registers toy_recall)

SETTINGS = dict(block_size=8, prefill_chunk=32, decide_every=2)


def recorded(model, task="toy_recall", length=200, sample_seed=5, protocol="streaming"):
    from eval.tasks.base import get_task
    from eval.tasks.prompt import build_prompt

    sample = get_task(task)(ByteTokenizer(), length, sample_seed, 0)
    prompt = build_prompt(ByteTokenizer(), sample, False)
    return record_episode(model, ByteTokenizer(), prompt, sample.max_new_tokens, protocol, **SETTINGS)


def fixed_scores(shape, seed=0):
    """Keep scores that depend on (layer, block) alone: the same action in the live env and in the replay."""
    return np.random.default_rng(seed).uniform(-1, 1, (*shape, 2)).astype(np.float32)


def first_mismatch(live, replay, task, action) -> int | None:
    """Step both envs with the same action to the end; the first step whose tiers, bytes or end differ."""
    live.reset(options={"task": task, "length": 200, "budget": 0.3, "sample_seed": 5})
    replay.reset(options={"episode": 0, "budget": 0.3})
    steps, done = 0, False
    while not done:
        live_obs, _, done, _, live_info = live.step(action)
        replay_obs, reward, replay_done, _, replay_info = replay.step(action)
        steps += 1
        assert reward == pytest.approx(-replay_info["lost_mass"] - replay_info["transfer_cost"])
        if replay_done != done or replay_info["mb_moved"] != pytest.approx(live_info["mb_moved"]):
            return steps
        if not done:
            n = live._view.num_blocks
            device = replay_obs["blocks"][:, :n, TIER_COLUMNS[0]] > 0
            if not (np.array_equal(replay._tier[:, :n], live._view.tier.numpy())
                    and np.array_equal(device, live._view.tier.numpy() == Tier.DEVICE)
                    and np.allclose(replay_obs["layers"], live_obs["layers"])):  # pressure, budget, tier shares
                return steps
    return None


@pytest.mark.parametrize("task, protocol, scope", [("toy_recall", "streaming", "layer"), ("fake_turns", "multiturn", "layer"),
                                                   ("toy_recall", "streaming", "global")])
def test_replay_leaves_the_tiers_and_bytes_the_live_env_leaves(tiny_model, task, protocol, scope):
    """Both budget scopes: per layer, and one budget for the whole model (the scores decide each layer's share)."""
    live = make(tiny_model, tasks=(task,), protocol=protocol, host_blocks=6, budget_scope=scope)
    episode = recorded(tiny_model, task, 200, 5, protocol)
    replay = KVCacheReplayEnv([episode], host_blocks=6, transfer_cost=0.5, max_tokens=live.max_tokens,
                              budget_scope=scope)
    assert replay.observation_space == live.observation_space and replay.action_space == live.action_space
    action = fixed_scores(live.action_space.shape[:2])
    assert first_mismatch(live, replay, task, action) is None
    assert len(episode["features"]) >= 5
    # negative control: a replay with a smaller host tier than the live cache's drops what the live one keeps
    small = KVCacheReplayEnv([episode], host_blocks=1, transfer_cost=0.5, max_tokens=live.max_tokens,
                             budget_scope=scope)
    assert first_mismatch(live, small, task, action) is not None
    other = KVCacheReplayEnv([episode], host_blocks=6, transfer_cost=0.5, max_tokens=live.max_tokens,
                             budget_scope="layer" if scope == "global" else "global")
    assert first_mismatch(live, other, task, action) is not None  # and the other scope's replay is told apart
    live.close()


def test_checkers_pass_and_keeping_everything_loses_nothing(tiny_model, tmp_path):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    episode = recorded(tiny_model)
    gym_check(KVCacheReplayEnv([episode], host_blocks=4), skip_render_check=True)
    sb3_check(KVCacheReplayEnv([episode], host_blocks=4), warn=False)
    torch.save(episode, tmp_path / "a.pt")
    env = gym.make("kvgym/KVCacheReplay-v1", episodes=str(tmp_path), budget_range=(1.0, 1.0))
    env.reset(seed=0)
    budget, done, fits = env.unwrapped._budget_blocks, False, 0
    while not done:
        blocks = episode["features"][env.unwrapped._point].shape[1]
        _, reward, done, _, info = env.step(env.action_space.sample())
        if blocks <= budget:  # the run still fits its budget: nothing moves, nothing is lost
            fits += 1
            assert reward == 0.0 and info["lost_mass"] == 0.0 and info["mb_moved"] == 0.0
    assert fits >= 3


def test_the_future_mass_rewards_the_blocks_the_run_attends(tiny_model):
    """Scores from the recorded future (an oracle) lose less attention than the reverse ranking, step by step."""
    episode = recorded(tiny_model)
    env = KVCacheReplayEnv([episode], host_blocks=64)
    totals = {}
    for sign in (1.0, -1.0):
        env.reset(options={"episode": 0, "budget": 0.25})
        done, lost = False, 0.0
        while not done:
            future = np.asarray(episode["future"][env._point])
            action = np.zeros(env.action_space.shape, np.float32)
            action[:, : future.shape[1], 0] = sign * future / max(future.max(), 1e-9)
            action[:, :, 1] = -1.0
            _, _, done, _, info = env.step(action)
            lost += info["lost_mass"]
        totals[sign] = lost
    assert totals[1.0] < totals[-1.0] and totals[-1.0] > 0


@pytest.mark.parametrize("call, message", [
    (lambda ep: KVCacheReplayEnv([ep], budget_range=(0.5, 0.1)), "budget_range"),
    (lambda ep: KVCacheReplayEnv([ep], host_blocks=-1), "host_blocks"),
    (lambda ep: KVCacheReplayEnv([ep], transfer_cost={"device->moon": 1.0}), "unknown tier pairs"),
    (lambda ep: KVCacheReplayEnv([ep], transfer_cost=float("nan")), "transfer_cost"),
    (lambda ep: KVCacheReplayEnv([]), "none given"),
    (lambda ep: KVCacheReplayEnv([{"format": "other"}]), "not a recorded episode"),
    (lambda ep: KVCacheReplayEnv([ep]).reset(options={"episode": 3}), "holds 1 episodes"),
    (lambda ep: KVCacheReplayEnv([ep]).reset(options={"task": "x"}), "the options are"),
    (lambda ep: KVCacheReplayEnv([ep], max_tokens=16), "max_tokens 16"),
    (lambda ep: KVCacheReplayEnv([ep], budget_scope="model"), "budget_scope 'model'"),
])
def test_bad_input_is_refused_with_its_name(tiny_model, call, message):
    with pytest.raises(ValueError, match=message):
        call(recorded(tiny_model))


def test_bad_files_actions_and_protocols_are_refused(tiny_model, tmp_path):
    (tmp_path / "broken.pt").write_bytes(b"half")
    with pytest.raises(ValueError, match="broken.pt: not a recorded episode"):
        KVCacheReplayEnv(str(tmp_path))
    with pytest.raises(ValueError, match="no recorded episodes"):
        KVCacheReplayEnv(str(tmp_path / "empty"))
    env = KVCacheReplayEnv([recorded(tiny_model)])
    with pytest.raises(gym.error.ResetNeeded):
        env.step(env.action_space.sample())
    env.reset(seed=0)
    with pytest.raises(ValueError, match="expected finite values of shape"):
        env.step(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="one-shot"):
        record_episode(tiny_model, ByteTokenizer(), *_prompt("toy_recall"), "oneshot")


def _prompt(task):
    from eval.tasks.base import get_task
    from eval.tasks.prompt import build_prompt

    sample = get_task(task)(ByteTokenizer(), 200, 5, 0)
    return build_prompt(ByteTokenizer(), sample, False), sample.max_new_tokens


def test_offloaded_blocks_lose_the_latest_attention_a_live_cache_would_not_see(tiny_model):
    from kvgym.envs.kvcache_replay import RANK_COLUMNS, SHARE_COLUMNS

    env = KVCacheReplayEnv([recorded(tiny_model)], host_blocks=64)
    observation, _ = env.reset(options={"episode": 0, "budget": 0.25})
    action = fixed_scores(env.action_space.shape[:2])
    checked = 0
    for _ in range(6):
        observation, _, done, _, _ = env.step(action)
        n = env._episode["features"][env._point].shape[1]
        off = (env._tier[:, :n] == Tier.HOST)
        if off.any():
            blocks = observation["blocks"][:, :n]
            assert np.allclose(blocks[off][:, SHARE_COLUMNS], np.log(1e-4))
            device = env._tier[:, :n] == Tier.DEVICE
            shares = (np.exp(blocks[:, :, SHARE_COLUMNS].astype(np.float64)) - 1e-4) / n
            sums = np.where(device[..., None], shares, 0.0).sum(axis=1)  # [L, 4]: each layer's residents hold it all
            assert np.allclose(sums[sums > 1e-6], 1.0, atol=1e-3)
            assert (blocks[off][:, RANK_COLUMNS] <= blocks[device][:, RANK_COLUMNS].max()).all()
            checked += 1
        if done:
            break
    assert checked


def test_a_recorded_episode_is_the_sample_the_live_env_and_kvgym_eval_run(tiny_model, tmp_path):
    """``record_episodes`` draws ``kvgym eval --seed``'s samples; the live env's reset with the episode's
    ``sample_seed`` and ``index`` runs the same one: the full cache's answer is the recorded one. Negative control:
    index 0 with the same seed is another sample."""
    from eval.tasks.base import sample_seed
    from kvgym.envs.kvcache_replay import load_episodes, record_episodes

    paths = record_episodes(tiny_model, ByteTokenizer(), ["toy_recall"], [200], 2, 3, tmp_path, block_size=8,
                            prefill_chunk=32, decide_every=2, log=lambda _: None)
    episode = load_episodes([paths[1]])[0]
    assert episode["index"] == 1 and episode["sample_seed"] == sample_seed(3, "toy_recall", 200, 1)
    live = make(tiny_model, host_blocks=6)
    live.reset(options={"task": "toy_recall", "length": 200, "budget": 0.3, "sample_seed": episode["sample_seed"],
                        "index": episode["index"]})
    assert ByteTokenizer().decode(live._ref["tokens"][0]) == episode["text"]
    first = live._sample
    live.reset(options={"task": "toy_recall", "length": 200, "budget": 0.3, "sample_seed": episode["sample_seed"]})
    assert live._sample.context != first.context
    live.close()
