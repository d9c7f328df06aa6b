"""The live Gymnasium environment on the tiny model: checkers, determinism, a random fuzz, reward sanity."""

import random
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import torch

import kvgym  # noqa: F401  (registers kvgym/PagedKVCache-v0)
from cache.tiers import Tier
from eval.tasks.base import Sample, register_task
from kvgym.envs.paged_kv import PagedKVCacheEnv


class ByteTokenizer:
    """Characters to ids 2..255 and back; enough for the tiny random model."""

    eos_token_id = None

    def __call__(self, text, return_tensors=None):
        ids = [2 + ord(c) % 254 for c in text]
        return SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr((i - 2) % 254) for i in ids)


@register_task("toy_recall")
def toy_recall(tokenizer, length, seed, index):
    rng = random.Random(seed * 1000 + index)
    key = str(rng.randint(100, 999))
    filler = "".join(rng.choice("abcdefgh ") for _ in range(length - 40))
    cut = rng.randint(0, len(filler))
    text = filler[:cut] + f" the key is {key}. " + filler[cut:]
    return Sample("toy_recall", length, seed, index, text[:length - 12], " key: ", [key], "exact", max_new_tokens=6)


def make_env(**kwargs):
    from tests.conftest import make_tiny_llama

    defaults = dict(model=make_tiny_llama(), tokenizer=ByteTokenizer(), tasks=("toy_recall",), lengths=(160, 200),
                    budget_range=(0.3, 0.6), num_candidates=8, prefill_chunk=32, decide_every=2)
    return PagedKVCacheEnv(**{**defaults, **kwargs})


def test_gymnasium_and_sb3_checkers_pass():
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    gym_check(make_env(), skip_render_check=True)
    sb3_check(make_env(), warn=True)


def test_registered_and_made_through_gym_make():
    env = gym.make("kvgym/PagedKVCache-v0", **{k: v for k, v in dict(
        model=make_env().model, tokenizer=ByteTokenizer(), tasks=("toy_recall",), lengths=(160,),
        num_candidates=8, prefill_chunk=32).items()})
    observation, info = env.reset(seed=1)
    assert set(observation) == {"layer_pressure", "tier_occupancy", "blocks", "globals"}
    assert info["action_mask"].shape == (8, 4) and info["action_mask"][:, 0].all()


def rollout(env, seed, steps):
    observation, info = env.reset(seed=seed)
    env.action_space.seed(seed)
    trace = [observation["blocks"].copy()]
    rewards = []
    for _ in range(steps):
        action = env.action_space.sample(mask=tuple(info["action_mask"]))
        observation, reward, terminated, truncated, info = env.step(action)
        trace.append(observation["blocks"].copy())
        rewards.append(reward)
        if terminated:
            break
    return trace, rewards


def test_same_seed_same_observations_and_rewards():
    a, b = make_env(), make_env()
    trace_a, rewards_a = rollout(a, seed=7, steps=12)
    trace_b, rewards_b = rollout(b, seed=7, steps=12)
    assert rewards_a == rewards_b
    assert all(np.array_equal(x, y) for x, y in zip(trace_a, trace_b, strict=True))
    trace_c, _ = rollout(make_env(), seed=8, steps=12)
    assert not all(np.array_equal(x, y) for x, y in zip(trace_a, trace_c, strict=False))


def test_random_action_fuzz_keeps_every_invariant():
    env = make_env(decide_every=1, lengths=(96, 128), num_candidates=6)
    steps, episodes = 0, 0
    rng = np.random.default_rng(0)
    while steps < 2000:
        observation, info = env.reset(seed=int(rng.integers(1 << 30)))
        episodes += 1
        seen = env.cache.seen
        while True:
            mask = info["action_mask"].astype(bool)
            action = np.array([rng.choice(np.flatnonzero(row)) for row in mask])
            observation, reward, terminated, truncated, info = env.step(action)
            steps += 1
            cache = env.cache
            assert np.isfinite(reward)
            assert all(np.isfinite(v).all() for v in observation.values())
            assert cache.seen >= seen  # positions only move forward
            seen = cache.seen
            for layer in range(cache.num_layers):
                device = cache.tables.count_in(layer, Tier.DEVICE)
                assert device == int((cache.tables.tier[layer] == Tier.DEVICE).sum())
                assert cache.device_pool(layer).allocator.num_used == device  # no leaked device blocks
                host = int((cache.tables.tier[layer] == Tier.HOST).sum())
                assert cache.pools[layer][Tier.HOST].allocator.num_used == host  # no leaked host blocks
            assert info["within_budget"], "the budget was exceeded after a decision"
            if terminated:
                break
    assert episodes > 1


def test_reward_sanity_full_cache_vs_evicting_everything():
    def episode_kl(env, policy):
        observation, info = env.reset(seed=3)
        total = 0.0
        while True:
            observation, reward, terminated, truncated, info = env.step(policy(info["action_mask"]))
            total += info["kl"]
            if terminated:
                return total

    keep_all = make_env(budget_range=(1.0, 1.0))
    kl_full = episode_kl(keep_all, lambda mask: np.zeros(len(mask), dtype=np.int64))
    evict_all = make_env(budget_range=(0.1, 0.1), host_blocks=0)
    kl_evict = episode_kl(evict_all, lambda mask: np.where(mask[:, 1], 1, 0))
    assert kl_full < 1e-3
    assert kl_evict > 100 * max(kl_full, 1e-4)


def test_render_modes():
    env = make_env(render_mode="ansi")
    env.reset(seed=0)
    text = env.render()
    assert text.startswith("L00 ") and "D" in text
    env = make_env(render_mode="rgb_array")
    env.reset(seed=0)
    image = env.render()
    assert image.dtype == np.uint8 and image.shape[2] == 3 and image.shape[0] == 2 * 4


def test_masked_action_is_ignored_and_counted():
    env = make_env()
    _, info = env.reset(seed=0)
    mask = info["action_mask"]
    slot = int(np.flatnonzero(mask[:, 3] == 0)[0])  # prefetch is illegal for a device block
    action = np.zeros(len(mask), dtype=np.int64)
    action[slot] = 3
    _, _, _, _, info = env.step(action)
    assert info["illegal_ops"] == 1 and info["ops"].get("prefetch", 0) == 0
