"""The one reward function (``kvgym.envs.reward``) behind the live and the replay env, and the live env's
teacher-forced KL."""

import dataclasses

import numpy as np
import pytest

from kvgym.envs.reward import REWARD_TERMS, reward, reward_terms
from tests.test_env import ByteTokenizer, make_env, toy_recall

KEEP_ALL = np.zeros(8, np.int64)  # the tests' envs have 8 candidate slots; the budget fallback evicts


def test_reward_terms():
    terms = reward_terms(0.5, 3 * 2**20, task_score=1.0, lost_mass=0.25, lambda_bytes=0.1, lambda_task=2.0,
                         mass_scale=4.0)
    assert terms == {"kl": -0.5, "mass": -1.0, "bytes": pytest.approx(-0.3), "task": 2.0}
    assert tuple(terms) == REWARD_TERMS
    assert reward(terms) == pytest.approx(-0.5 - 1.0 - 0.3 + 2.0)


def run(env, **reset):
    """One keep-all episode: the reset info and every step's (reward, info)."""
    _, first = env.reset(**reset)
    steps = []
    while True:
        _, value, terminated, _, info = env.step(KEEP_ALL)
        steps.append((value, info))
        if terminated:
            return first, steps


def check_terms(steps, lambda_bytes, lambda_task=1.0, mass_scale=0.0):
    for value, info in steps:
        expected = reward_terms(info["kl"], info["bytes_moved"], info["task_score"], info.get("lost_mass", 0.0),
                                lambda_bytes=lambda_bytes, lambda_task=lambda_task, mass_scale=mass_scale)
        assert info["reward_terms"] == expected
        assert value == reward(expected)


def test_live_and_replay_envs_reward_with_the_one_function():
    from kvgym.envs.replay import PagedKVCacheReplayEnv
    from kvgym.envs.traces import build_trace

    live = make_env(budget_range=(0.2, 0.2), host_blocks=2, lambda_bytes=50.0, lambda_task=3.0)
    _, steps = run(live, seed=1)
    check_terms(steps, lambda_bytes=50.0, lambda_task=3.0)
    assert any(info["bytes_moved"] for _, info in steps) and any(info["kl"] > 0 for _, info in steps)

    trace = build_trace(live.model, ByteTokenizer(), toy_recall(ByteTokenizer(), 200, 3, 0), prefill_chunk=32)
    replay = PagedKVCacheReplayEnv([trace], num_candidates=8, prefill_chunk=32, decide_every=2,
                                   budget_range=(0.2, 0.2), host_blocks=2, lambda_bytes=50.0, mass_scale=2.0)
    _, steps = run(replay, seed=0)
    check_terms(steps, lambda_bytes=50.0, mass_scale=2.0)
    assert any(info["lost_mass"] > 0 for _, info in steps) and any(info["bytes_moved"] for _, info in steps)


class RecordingModel:
    """The model, recording the input ids of every forward pass."""

    def __init__(self, model):
        self.model, self.config, self.fed = model, model.config, []

    def __call__(self, input_ids, **kwargs):
        self.fed.append(input_ids[0].tolist())
        return self.model(input_ids=input_ids, **kwargs)


def fed_and_kl(env, seed, tokens=None):
    """One keep-all episode (fed ``tokens`` instead of the reference's when given): per step, everything the
    cache was fed since the reset, and the step's KL."""
    env.reset(seed=seed)
    if tokens is not None:
        env.reference = dataclasses.replace(env.reference, tokens=tokens)
    start = len(env.model.fed)
    rows = []
    while True:
        _, _, terminated, _, info = env.step(KEEP_ALL)
        rows.append((list(env.model.fed[start:]), info["kl"]))
        if terminated:
            return rows


def test_live_kl_is_teacher_forced_on_the_reference_tokens():
    """Under a tight budget this cache's greedy picks leave the full cache's continuation, yet its cache is fed
    the reference's tokens, so each step's KL compares the two caches on the same prefix. Negative control: the
    same episode fed a divergent continuation (this cache's own picks, as an env following its own greedy
    decoding would feed) gives the same KL while the fed prefixes agree, and a different KL once they differ."""
    env = make_env(budget_range=(0.15, 0.15), host_blocks=0, lengths=(200,))
    env.model = RecordingModel(env.model)
    forced = fed_and_kl(env, seed=0)
    reference, picks = env.reference.tokens, list(env.generated)
    assert picks[:-1] != reference[: len(picks) - 1], "the test needs this cache to pick other tokens"
    chunks = [env.prompt_ids[start : start + 32] for start in range(32, len(env.prompt_ids), 32)]
    assert forced[-1][0] == chunks + [[token] for token in reference[: len(picks) - 1]]  # the last is never fed

    own = fed_and_kl(env, seed=0, tokens=picks)
    assert own[-1][0] == chunks + [[token] for token in picks[: len(picks) - 1]]
    same = [(kl, other) for (fed, kl), (other_fed, other) in zip(forced, own, strict=True) if fed == other_fed]
    assert same and all(kl == other for kl, other in same)
    assert len(same) < len(forced)
    assert sum(kl for _, kl in own) != pytest.approx(sum(kl for _, kl in forced), rel=1e-3)
