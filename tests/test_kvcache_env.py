"""``kvgym/KVCache-v1`` on the tiny random Llama: the checkers, streaming and multi-turn episodes driven by a random
policy and by the shipped ranker (every step within budget, no fallback), the reward's parts, bad input."""

import gymnasium as gym
import numpy as np
import pytest

import kvgym  # noqa: F401  (registers the envs)
from cache.ranking import RANK_FEATURES
from kvgym.envs.kvcache import GLOBAL_COLUMNS, KVCacheEnv, squash
from tests.test_harness import ByteTokenizer
from tests.test_harness_protocols import fake_turns  # noqa: F401  (registers fake_turns: a three-turn sample)
from tests.toy import toy_recall  # noqa: F401  (registers toy_recall)

BUDGET_COLUMN = GLOBAL_COLUMNS.index("budget")


def make(model, **kwargs):
    settings = dict(model=model, tokenizer=ByteTokenizer(), tasks=("toy_recall",), lengths=(160, 200),
                    budget_range=(0.3, 0.6), block_size=8, prefill_chunk=32, decide_every=2, max_tokens=320)
    return KVCacheEnv(**{**settings, **kwargs})


def test_gymnasium_and_sb3_checkers_pass(tiny_model):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    env = make(tiny_model)
    gym_check(env, skip_render_check=True)
    sb3_check(make(tiny_model), warn=False)
    env.close()
    assert gym.spec("kvgym/KVCache-v1").entry_point == "kvgym.envs.kvcache:KVCacheEnv"


def run_episode(env, policy, seed, **options):
    """Steps ``policy(observation) -> action`` to the end; returns the rewards and every step's info."""
    observation, _ = env.reset(seed=seed, options=options)
    rewards, infos, done = [], [], False
    while not done:
        observation, reward, done, truncated, info = env.step(policy(observation))
        assert not truncated
        rewards.append(reward)
        infos.append(info)
    return rewards, infos


@pytest.mark.parametrize("task, protocol", [("toy_recall", "streaming"), ("fake_turns", "multiturn")])
def test_a_random_policy_keeps_every_budget_without_fallbacks(tiny_model, task, protocol):
    """The cache's fallback evicts (and counts) whatever a decision leaves over budget, right after it: 0 fallbacks
    over every decision point means every step's action met its budget."""
    env = make(tiny_model, tasks=(task,), protocol=protocol, host_blocks=16)
    rng = np.random.default_rng(0)
    rewards, infos = run_episode(env, lambda obs: rng.uniform(-1, 1, env.action_space.shape).astype(np.float32), 1)
    assert len(rewards) >= 5  # many decision points: prefill chunks, the question, decode steps (and turns)
    assert infos[-1]["fallbacks"] == 0 and infos[-1]["decisions"] == len(rewards)
    assert all(np.isfinite(rewards)) and 0.0 <= infos[-1]["score"] <= 1.0
    if protocol == "multiturn":
        assert env._ref["tokens"].keys() == {0, 1, 2}  # the reference answered all three turns


def test_the_shipped_ranker_drives_streaming_and_multiturn_episodes(tiny_model):
    """The policy a user trains or ships, fed the observation alone: its scores, squashed into the action bounds,
    make the same choices (an increasing map) and keep every layer within budget."""
    from agents.ranker.model import load_ranker

    scorer = load_ranker("policies/ranker_smollm2.pt")[0].inference()

    def policy(observation):
        keep, merge = scorer(observation["blocks"])
        return np.stack([squash(keep), squash(merge)], axis=-1)

    for task, protocol in [("toy_recall", "streaming"), ("fake_turns", "multiturn")]:
        env = make(tiny_model, tasks=(task,), protocol=protocol, host_blocks=16)
        rewards, infos = run_episode(env, policy, seed=3)
        assert infos[-1]["fallbacks"] == 0 and infos[-1]["decisions"] == len(rewards) >= 5
    keep = np.array([-50.0, -2.0, -0.5, 0.0, 1e-3, 3.0, 1e6])
    assert (np.argsort(squash(keep), kind="stable") == np.argsort(keep, kind="stable")).all()
    assert np.abs(squash(keep)).max() < 1


def keep_oldest(observation):
    keep = -observation["blocks"][..., RANK_FEATURES.index("position")]
    return np.stack([keep, -np.ones_like(keep)], axis=-1).astype(np.float32)


def test_the_reward_is_the_task_score_minus_kl_and_bytes(tiny_model):
    """The return is the task score minus the KL of the answer positions minus 0.5 per MB moved; a smaller budget
    (with a host tier) costs more KL than the whole context's budget."""
    env = make(tiny_model, host_blocks=64, transfer_cost=0.5)
    kls = {}
    for budget in (1.0, 0.3):
        rewards, infos = run_episode(env, keep_oldest, seed=5, budget=budget)
        kl, moved = sum(i["kl"] for i in infos), sum(i["mb_moved"] for i in infos)
        assert infos[-1]["kl_positions"] > 0
        assert sum(rewards) == pytest.approx(infos[-1]["score"] - kl - 0.5 * moved)
        assert sum(i["transfer_cost"] for i in infos) == pytest.approx(0.5 * moved)
        kls[budget] = kl
    assert 0.0 <= kls[1.0] < kls[0.3] and moved > 0  # at 0.3 evicted blocks went to the host tier


def test_a_global_budget_lets_the_policy_choose_each_layers_share(tiny_model):
    """budget_scope="global": the highest scores over all layers stay, so a policy that prefers layer 0 leaves
    layer 1 its pinned blocks only, with the total within budget and no fallback; per layer (the negative control)
    both layers keep the same share."""
    def prefer_layer_0(observation):
        keep = np.where(np.arange(observation["mask"].shape[0])[:, None] == 0, 0.9, -0.9) * observation["mask"]
        return np.stack([keep, -np.ones_like(keep)], axis=-1).astype(np.float32)

    gaps = {}
    for scope in ("global", "layer"):
        env = make(tiny_model, budget_scope=scope)
        observation, _ = env.reset(seed=4, options={"budget": 0.4})
        done, gap = False, []
        while not done:
            observation, _, done, _, info = env.step(prefer_layer_0(observation))
            device = env._view.device_blocks().numpy()
            gap.append(int(device[0] - device[1]))
            if scope == "global" and not done:  # the total holds (plus the blocks written since the decision)
                assert device.sum() <= env._view.budget_blocks.sum() + 2 * 4
        assert info["fallbacks"] == 0
        gaps[scope] = max(gap)
    assert gaps["global"] >= 4 and gaps["layer"] == 0


def test_transfer_costs_follow_a_bandwidth_model_per_tier_pair(tiny_model):
    """Per tier pair: moving to the host and back over PCIe costs 1/25 ms per MB, anything touching the disk 1/3;
    an env charging only device->host costs exactly that pair's MB."""
    from kvgym.envs.kvcache import bandwidth_costs

    costs = bandwidth_costs(per_ms=1.0)
    assert costs["device->host"] == costs["host->device"] == pytest.approx(1 / 25)
    assert costs["device->disk"] == costs["disk->host"] == pytest.approx(1 / 3)
    env = make(tiny_model, host_blocks=64, transfer_cost={"device->host": 2.0})
    _, infos = run_episode(env, keep_oldest, seed=5, budget=0.3)
    charged = sum(i["transfer_cost"] for i in infos)
    moved = env.last_result.bytes_moved  # {"device->host": bytes, ...}
    assert charged == pytest.approx(2.0 * moved["device->host"] / 1e6) and charged > 0
    env = make(tiny_model, host_blocks=64, transfer_cost={"host->device": 2.0})  # negative control: no prefetch
    _, infos = run_episode(env, keep_oldest, seed=5, budget=0.3)
    assert sum(i["transfer_cost"] for i in infos) == 0.0 and env.last_result.bytes_moved["device->host"] > 0


def test_one_shot_protocols_are_one_step_episodes(tiny_model):
    env = make(tiny_model, protocol="oneshot-question")
    _, info = env.reset(seed=2)
    _, reward, done, _, info = env.step(env.action_space.sample())
    assert done and info["decisions"] == 1 and info["fallbacks"] == 0


BAD = [
    (dict(protocol="stream"), "protocol 'stream'"),
    (dict(budget_range=(0.5, 0.1)), "low <= high"),
    (dict(tasks=()), "give at least one task"),
    (dict(tasks="toy_recall,nope"), "unknown task 'nope'"),
    (dict(transfer_cost=float("nan")), "transfer_cost device->host nan"),
    (dict(transfer_cost={"gpu->host": 1.0}), "unknown tier pairs"),
    (dict(decide_every=0), "decide_every 0"),
    (dict(prefill_chunk=0), "prefill_chunk 0"),
    (dict(max_new_tokens=-5), "max_new_tokens -5"),
    (dict(kl_weight=-1.0), "kl_weight -1.0"),
    (dict(host_blocks=-1), "host_blocks -1"),
    (dict(max_tokens=100), "max_tokens 100"),  # raised at reset: the samples do not fit
]


@pytest.mark.parametrize("kwargs, message", BAD)
def test_bad_settings_are_refused_with_the_setting_named(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(tiny_model, **kwargs).reset(seed=0)


def test_bad_actions_and_calls_out_of_order_are_refused(tiny_model):
    env = make(tiny_model)
    with pytest.raises(gym.error.ResetNeeded):
        env.step(env.action_space.sample())
    with pytest.raises(gym.error.ResetNeeded):
        env.render()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros((2, 3, 2), np.float32))
    bad = env.action_space.sample()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        env.step(bad)
    with pytest.raises(ValueError, match="reset options"):
        env.reset(options={"temperature": 1})
    env.close()


def test_the_vector_env_steps_episodes_as_they_step_alone_with_batched_forwards(tiny_model, monkeypatch):
    """Three episodes (other samples, lengths, budgets) in ``KVCacheVectorEnv`` against the same three in
    ``KVCacheEnv``, one by one, with the same deterministic policy: the same observations, rewards and ends (to float
    rounding); the forwards went through the model batched; an ended episode starts again on the next step."""
    import cache.batched
    from kvgym.envs.kvcache import KVCacheVectorEnv

    rows = []
    real = cache.batched.batched_forward
    monkeypatch.setattr(cache.batched, "batched_forward",
                        lambda model, caches, ids: rows.append(len(caches)) or real(model, caches, ids))
    column = RANK_FEATURES.index("last_query_mean_rank")

    def policy(observation):  # keep the blocks the latest query attended most
        action = np.zeros(observation["blocks"].shape[:-1] + (2,), np.float32)
        action[..., 0] = squash(observation["blocks"][..., column] * 4 - 2)
        action[..., 1] = -1.0
        return action

    options = [{"length": 160, "budget": 0.4, "sample_seed": 3}, {"length": 200, "budget": 0.5, "sample_seed": 4},
               {"length": 160, "budget": 0.3, "sample_seed": 5}]
    settings = dict(model=tiny_model, tokenizer=ByteTokenizer(), tasks=("toy_recall",), lengths=(160, 200),
                    block_size=8, prefill_chunk=32, decide_every=2, max_tokens=320, host_blocks=8)
    alone = []
    for option in options:
        env = make(tiny_model, host_blocks=8)
        observation, _ = env.reset(seed=0, options=option)
        episode = [(observation, 0.0, False)]
        done = False
        while not done:
            observation, reward, done, _, _ = env.step(policy(observation))
            episode.append((observation, reward, done))
        alone.append(episode)
    vector = gym.make_vec("kvgym/KVCache-v1", num_envs=3, vectorization_mode="vector_entry_point", **settings)
    assert isinstance(vector.unwrapped, KVCacheVectorEnv)
    observations, _ = vector.reset(seed=0, options=options)
    steps = max(len(episode) for episode in alone)
    restarted = set()
    rewards, terminations, infos = np.zeros(3), np.zeros(3, bool), {}  # step 0 (the reset) checks observations only
    for step in range(steps):
        for index, episode in enumerate(alone):
            if step < len(episode):
                observation, reward, done = episode[step]
                got = {key: value[index] for key, value in observations.items()}
                assert all(np.allclose(got[key], observation[key], atol=1e-4) for key in observation), (index, step)
                if step:
                    assert rewards[index] == pytest.approx(reward, abs=1e-4) and terminations[index] == done
            elif step == len(episode):  # the step after its end: it started again (next-step autoreset)
                assert rewards[index] == 0.0 and not terminations[index] and infos["_task"][index]
                restarted.add(index)
        if step == steps - 1:
            break
        actions = np.stack([policy({key: value[i] for key, value in observations.items()}) for i in range(3)])
        observations, rewards, terminations, truncations, infos = vector.step(actions)
        assert not truncations.any()
    assert rows and max(rows) == 3  # the three runs shared forwards
    assert not np.allclose(alone[0][1][0]["blocks"], alone[2][1][0]["blocks"])  # the episodes differ: a swap shows
    assert restarted == {i for i, episode in enumerate(alone) if len(episode) < steps} != set()
    vector.close()
