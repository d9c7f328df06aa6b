"""The trace-replay env on the tiny model: traces, checkers, equivalence with the live env's encoding, rewards,
a random fuzz with invariants, speed, and the replay-vs-live correlation."""

import json
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

import kvgym  # noqa: F401  (registers the envs)
from eval.replay_compare import rankdata, replay_live_correlation, spearman
from kvgym.envs.observation import encode, smallest_stable
from kvgym.envs.replay import (
    DEVICE,
    DROPPED,
    HOST,
    PagedKVCacheReplayEnv,
)
from kvgym.envs.traces import Trace, build_trace, build_traces
from tests.test_env import ByteTokenizer, make_env, toy_recall

ENV = dict(num_candidates=8, prefill_chunk=32, decide_every=2, budget_range=(0.3, 0.6))


@pytest.fixture(scope="module")
def model():
    from tests.conftest import make_tiny_llama

    return make_tiny_llama()


@pytest.fixture(scope="module")
def traces(model):
    tokenizer = ByteTokenizer()
    return [build_trace(model, tokenizer, toy_recall(tokenizer, length, 3, index), prefill_chunk=32)
            for index, length in enumerate((160, 200))]


def make_replay(traces, **kwargs):
    return PagedKVCacheReplayEnv(traces, **{**ENV, **kwargs})


def test_trace_contents_and_round_trip(traces, tmp_path):
    trace = traces[0]
    forwards, layers, blocks = trace.mass.shape
    assert (layers, trace.meta["prompt_tokens"], trace.meta["max_new_tokens"]) == (2, 143, 6)
    assert forwards == 5 + 5  # 5 prefill chunks of 32, then max_new_tokens - 1 decode steps
    assert trace.seen.tolist()[:5] == [32, 64, 96, 128, 143] and trace.seen[-1] == 143 + 5
    assert blocks == -(-int(trace.seen[-1]) // 16)
    # each forward hands out one unit of mass per query, per layer
    assert torch.allclose(trace.mass.float().sum(-1), trace.queries[:, None].float().expand(-1, layers), atol=0.05)
    assert trace.last_query.shape == (forwards, layers, 4, 16) and trace.mean_key.shape == (layers, blocks, 2, 16)
    assert trace.num_tokens.sum() == trace.seen[-1] and trace.sentence_boundary.any()  # "the key is NNN."
    path = trace.save(tmp_path / "t.pt")
    loaded = Trace.load(path)
    assert loaded.meta == trace.meta
    for name in Trace.TENSORS:
        assert torch.equal(getattr(loaded, name), getattr(trace, name)), name
    with pytest.raises(ValueError, match="decide_every"):
        build_trace(None, None, [1, 2, 3], decide_every=8)


def test_build_traces_writes_files_and_index(model, tmp_path):
    entries = build_traces(model, ByteTokenizer(), ["toy_recall"], [120], 2, 5, tmp_path, prefill_chunk=32,
                           progress=False)
    assert [e["file"] for e in entries] == ["toy_recall_120_0.pt", "toy_recall_120_1.pt"]
    index = json.loads((tmp_path / "index.json").read_text())
    assert [e["file"] for e in index["traces"]] == ["toy_recall_120_0.pt", "toy_recall_120_1.pt"]
    env = PagedKVCacheReplayEnv(tmp_path, **ENV)  # a folder works as the trace source
    assert len(env.sources) == 2
    env.reset(seed=0)


def test_cli_traces_parser():
    from kvgym.cli import build_parser

    args = build_parser().parse_args(["traces", "build", "--model", "m", "--tasks", "passkey,niah_single",
                                      "--lengths", "1024,2048", "--n", "3", "--seed", "7", "--out", "d"])
    assert (args.command, args.traces, args.tasks, args.lengths, args.n, args.seed) == (
        "traces", "build", "passkey,niah_single", [1024, 2048], 3, 7)


def test_checkers_pass_and_spaces_equal_the_live_env(traces):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    gym_check(make_replay(traces), skip_render_check=True)
    sb3_check(make_replay(traces), warn=True)
    live = make_env()
    replay = make_replay(traces)
    assert replay.observation_space == live.observation_space
    assert replay.action_space == live.action_space


def test_registered_and_made_through_gym_make(traces):
    env = gym.make("kvgym/PagedKVCacheReplay-v0", traces=traces, **ENV)
    observation, info = env.reset(seed=1)
    assert set(observation) == {"layer_pressure", "tier_occupancy", "blocks", "globals"}
    assert info["action_mask"].shape == (8, 4) and info["action_mask"][:, 0].all()


def test_observation_is_exactly_encode_of_the_view(traces):
    """The vectorised observation equals ``observation.encode`` of the replay's ``CacheView``, step after step."""
    env = make_replay(traces)
    rng = np.random.default_rng(1)
    for episode in range(6):
        observation, info = env.reset(seed=episode)
        while True:
            view = env.view()
            encoded = encode(view, env.num_candidates, view.seen / env.total_tokens, env.budget_fraction,
                             env.bytes_moved_total / env.full_bytes)
            for key in observation:
                assert np.array_equal(observation[key], encoded.observation[key]), key
            assert np.array_equal(info["action_mask"].astype(bool), encoded.mask)
            assert env.encoded.candidates == encoded.candidates
            action = np.array([rng.choice(np.flatnonzero(row)) for row in encoded.mask])
            observation, _, terminated, _, info = env.step(action)
            if terminated:
                break


def test_first_observation_matches_the_live_env(model):
    """Same sample, same budget: the replay's first observation is the live env's (same model, same chunk)."""
    live = make_env(model=model)
    observation, _ = live.reset(seed=4)
    trace = build_trace(model, live.tokenizer, live.prompt_ids, prefill_chunk=32, max_new_tokens=live.new_tokens)
    replay = PagedKVCacheReplayEnv([trace], **ENV)
    replayed, _ = replay.reset(options={"trace": 0, "budget_fraction": live.budget_fraction})
    for key in observation:
        np.testing.assert_allclose(replayed[key], observation[key], atol=1e-3, err_msg=key)
    # the same keep-everything episode makes the same decisions, fallbacks and byte moves
    while True:
        _, _, live_done, _, live_info = live.step(np.zeros(8, np.int64))
        _, _, replay_done, _, replay_info = replay.step(np.zeros(8, np.int64))
        assert (live_info["fallbacks"], live_info["bytes_moved"], live_info["seen"]) == (
            replay_info["fallbacks"], replay_info["bytes_moved"], replay_info["seen"])
        assert live_done == replay_done
        if live_done:
            break


def rollout(env, seed, steps=40):
    observation, info = env.reset(seed=seed)
    env.action_space.seed(seed)
    observations, rewards = [observation["blocks"].copy()], []
    for _ in range(steps):
        observation, reward, terminated, _, info = env.step(env.action_space.sample(mask=tuple(info["action_mask"])))
        observations.append(observation["blocks"].copy())
        rewards.append(reward)
        if terminated:
            break
    return observations, rewards


def test_same_seed_same_trajectory(traces):
    a, r_a = rollout(make_replay(traces), 7)
    b, r_b = rollout(make_replay(traces), 7)
    assert r_a == r_b and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    c, _ = rollout(make_replay(traces), 8)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=False))


def episode_totals(env, policy, **reset):
    observation, info = env.reset(**reset)
    kl = lost = 0.0
    while True:
        observation, reward, terminated, _, info = env.step(policy(info["action_mask"]))
        kl, lost = kl + info["kl"], lost + info["lost_mass"]
        if terminated:
            return kl, lost


def test_reward_sanity_full_budget_vs_evicting_everything(traces):
    keep = lambda mask: np.zeros(len(mask), np.int64)  # noqa: E731
    evict = lambda mask: np.where(mask[:, 1], 1, 0)  # noqa: E731
    kl_full, lost_full = episode_totals(make_replay(traces, budget_range=(1.0, 1.0)), keep, seed=3)
    kl_evict, lost_evict = episode_totals(make_replay(traces, budget_range=(0.1, 0.1), host_blocks=0), evict, seed=3)
    assert kl_full == 0.0 and lost_full == 0.0
    assert lost_evict > 1.0 and kl_evict > 1.0


def test_operations_move_blocks_between_tiers(traces):
    env = make_replay(traces, budget_range=(1.0, 1.0), host_blocks=1)
    _, info = env.reset(seed=0, options={"trace": 1})
    for _ in range(2):
        _, _, _, _, info = env.step(np.zeros(8, np.int64))
    slots = np.flatnonzero(info["action_mask"][:, 1])
    layer = int(env._layers[slots[0]])
    slots = slots[env._layers[slots] == layer][:2]
    assert len(slots) == 2
    action = np.zeros(8, np.int64)
    action[slots] = 1  # two evictions in one layer: the first fills its host pool (1 block), the second is dropped
    blocks = env._blocks[slots]
    _, _, _, _, info = env.step(action)
    assert info["ops"]["evict"] == 2 and info["bytes_moved"] == env.block_bytes
    assert env.tier[layer, blocks].tolist() == [HOST, DROPPED]
    # prefetch the hosted block back (its slot offers prefetch now)
    mask = info["action_mask"]
    host_slots = np.flatnonzero(mask[:, 3])
    if len(host_slots):
        action = np.zeros(8, np.int64)
        action[host_slots[0]] = 3
        _, _, _, _, info = env.step(action)
        assert info["ops"]["prefetch"] == 1 and info["bytes_moved"] >= env.block_bytes
    # a masked op is ignored and counted
    mask = info["action_mask"]
    slot = int(np.flatnonzero(mask[:, 3] == 0)[0])
    action = np.zeros(8, np.int64)
    action[slot] = 3
    _, _, _, _, info = env.step(action)
    assert info["illegal_ops"] == 1 and info["ops"]["prefetch"] == 0


def test_merge_is_a_drop_with_credit(traces):
    env = make_replay(traces, budget_range=(1.0, 1.0))
    _, info = env.reset(seed=0, options={"trace": 1})
    _, _, _, _, info = env.step(np.zeros(8, np.int64))
    slot = int(np.flatnonzero(info["action_mask"][:, 2])[0])
    layer, block = int(env._layers[slot]), int(env._blocks[slot])
    similarity = float(env._neighbour[slot])
    action = np.zeros(8, np.int64)
    action[slot] = 2
    _, _, _, _, info = env.step(action)
    assert info["ops"]["merge"] == 1 and info["bytes_moved"] == 0
    assert env.tier[layer, block] == DROPPED
    assert env.loss_weight[layer, block] == pytest.approx(1 - env.merge_credit * max(similarity, 0.0))


def test_random_fuzz_keeps_every_invariant_and_is_fast(traces):
    env = make_replay(traces, budget_range=(0.15, 0.6), host_blocks=3, decide_every=1, num_candidates=6)
    rng = np.random.default_rng(0)
    steps = episodes = 0
    elapsed = 0.0
    while steps < 2000:
        observation, info = env.reset(seed=int(rng.integers(1 << 30)))
        episodes += 1
        while True:
            action = np.array([rng.choice(np.flatnonzero(row)) for row in info["action_mask"].astype(bool)])
            start = time.perf_counter()
            observation, reward, terminated, _, info = env.step(action)
            elapsed += time.perf_counter() - start
            steps += 1
            assert np.isfinite(reward) and all(np.isfinite(v).all() for v in observation.values())
            assert env.observation_space.contains(observation)
            tier = env.tier[:, : env.n]
            assert info["within_budget"], "the budget was exceeded after a decision"
            assert np.array_equal(env.device_count, (tier == DEVICE).sum(axis=1))
            assert np.array_equal(env.host_used, (tier == HOST).sum(axis=1))  # no leaked host slots
            assert (env.host_used <= env.host_capacity).all()
            assert (tier[:, 0] == DEVICE).all() and (tier[:, -1] == DEVICE).all()  # pinned blocks stay
            assert (env.tier[:, env.n:] == -1).all()
            if terminated:
                break
    assert episodes > 10
    print(f"\nreplay env, tiny model, random masked actions: {steps / elapsed:.0f} steps/s ({steps} steps)")


def test_trace_chunk_grouping(traces):
    env = make_replay(traces, prefill_chunk=64)  # two recorded 32-token chunks per decision
    env.reset(seed=0, options={"trace": 0})
    assert env.data.prefill_forwards == 3 and int(env.data.seen[0]) == 64
    with pytest.raises(ValueError, match="multiple"):
        make_replay(traces, prefill_chunk=48)


def test_rank_helpers():
    assert rankdata([3.0, 1.0, 3.0, 2.0]).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        key = rng.integers(0, 5, size=(3, 17)).astype(np.float32)  # many ties
        counts = rng.integers(0, 18, size=3)
        rows, columns, rank = smallest_stable(key, counts)
        for row in range(3):
            expected = np.argsort(key[row], kind="stable")[: counts[row]]
            assert columns[rows == row].tolist() == expected.tolist()
            assert rank[rows == row].tolist() == list(range(counts[row]))
        single = smallest_stable(key[:1], counts[:1])[1]
        assert single.tolist() == np.argsort(key[0], kind="stable")[: counts[0]].tolist()


def test_replay_live_correlation_runs(model):
    result = replay_live_correlation(model, ByteTokenizer(), ["fallback", "lru", "evict:mass,extra=2", "merge:neighbour",
                                                              "random:0.3"],
                                     episodes=2, tasks=("toy_recall",), lengths=(160,), budget_range=(0.3, 0.6),
                                     num_candidates=8, prefill_chunk=32, decide_every=2)
    print(f"\nreplay vs live (tiny model, 5 policies x 2 episodes): spearman {result['spearman']:.3f}, within-episode "
          f"{result['spearman_within_episode']:.3f}, live {result['live_steps_per_s']:.0f} steps/s, replay "
          f"{result['replay_steps_per_s']:.0f} steps/s")
    assert result["pairs"] == 10
    assert -1.0 <= result["spearman"] <= 1.0


def test_replay_returns_table_is_deterministic(traces):
    from eval.replay_compare import replay_returns

    kwargs = {k: v for k, v in ENV.items() if k != "budget_range"}
    first = replay_returns(traces, ["fallback", "merge:mass"], budgets=(0.3, 0.6), env_kwargs=kwargs)
    assert first == replay_returns(traces, ["fallback", "merge:mass"], budgets=(0.3, 0.6), env_kwargs=kwargs)
    assert first["episodes_per_budget"] == 2 and set(first["policies"]) == {"fallback", "merge:mass"}
    low, high = first["policies"]["fallback"]["0.3"], first["policies"]["fallback"]["0.6"]
    assert low["return"] < 0 and low["kl"] >= high["kl"]  # a smaller budget loses at least as much
