"""N live episodes over one model, advanced by one batched forward pass per step.

``PagedKVCacheVecEnv`` is an SB3 ``VecEnv`` (MaskablePPO reads masks with ``env_method("action_masks")``; wrap it
in ``VecMonitor``/``VecNormalize`` as usual). ``PagedKVCacheVectorEnv`` is the Gymnasium ``VectorEnv`` over the
same machinery (``gym.make_vec("kvgym/PagedKVCache-v0", num_envs=N, vectorization_mode="vector_entry_point")``,
same-step autoreset). Each sub-env is a ``PagedKVCacheEnv`` sharing the model (one copy of the weights, one
paged cache per sequence); a step applies each env's action to its own cache, then drives every env's
``forwards()`` generator in lockstep: the envs that feed the same number of tokens next (decode steps: 1; prefill
chunks: the chunk size) share one ``model(...)`` call through ``cache.batched.BatchedPagedCache``. Episodes that
end are reset in the same step (their first prefill chunks batched too), SB3-style: the returned observation is
the new episode's, the last one is in ``info["terminal_observation"]``.

The full-cache reference pass of a new sample (one per task sample, cached) still runs one sequence at a time.
"""

from __future__ import annotations

import time
from collections import defaultdict

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3.common.vec_env.base_vec_env import VecEnv

from cache.batched import batched_forward
from kvgym.envs.paged_kv import PagedKVCacheEnv, check_action


def drive_batched(model, envs: list[PagedKVCacheEnv], generators: list, kl_positions: int) -> tuple[list[float], int]:
    """Run each env's ``forwards()`` generator to its end, batching the forwards that feed the same number of
    tokens; returns each generator's KL and the number of model calls made."""
    results: list[float] = [0.0] * len(generators)
    pending: dict[int, torch.Tensor] = {}
    for i, generator in enumerate(generators):
        try:
            pending[i] = next(generator)
        except StopIteration as stop:
            results[i] = stop.value
    calls = 0
    while pending:
        groups: dict[int, list[int]] = defaultdict(list)
        for i, ids in pending.items():
            groups[ids.shape[1]].append(i)
        for rows in groups.values():
            logits = batched_forward(model, [envs[i].cache for i in rows], torch.cat([pending[i] for i in rows]),
                                     logits_to_keep=kl_positions)
            calls += 1
            for row, i in enumerate(rows):
                try:
                    pending[i] = generators[i].send(logits[row])
                except StopIteration as stop:
                    results[i] = stop.value
                    del pending[i]
    return results, calls


class PagedKVCacheVecEnv(VecEnv):
    """SB3 ``VecEnv`` of ``num_envs`` live ``PagedKVCacheEnv`` episodes sharing one model (see the module doc).
    ``model``/``tokenizer`` as for ``PagedKVCacheEnv`` (a name is loaded once); ``max_episode_steps`` truncates
    (``info["TimeLimit.truncated"]``); other keyword arguments go to every sub-env."""

    def __init__(self, num_envs: int, model="smollm2-135m", tokenizer=None, max_episode_steps: int = 4096, **env_kwargs):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if isinstance(model, str):
            from cache.models import load_model

            loaded = load_model(model)
            model, tokenizer = loaded.model, loaded.tokenizer
        self.model, self.max_episode_steps = model, max_episode_steps
        self.envs = [PagedKVCacheEnv(model, tokenizer, **env_kwargs) for _ in range(num_envs)]
        first = self.envs[0]
        super().__init__(num_envs, first.observation_space, first.action_space)
        self.kl_positions = first.kl_positions
        self._actions: np.ndarray | None = None
        self._seeds: list[int | None] = [None] * num_envs
        self.episode_steps = np.zeros(num_envs, np.int64)
        self.model_calls = 0  # batched forward passes made (for benchmarks)
        self.closed = False

    # ------------------------------------------------------------------ batching
    def _start(self, indices: list[int]) -> list[tuple[dict, dict]]:
        """Start new episodes in ``indices`` (seeded once after ``seed()``) with their first chunks batched."""
        for i in indices:
            self.envs[i].start_episode(self._seeds[i])
            self._seeds[i] = None
            self.episode_steps[i] = 0
        kls, calls = drive_batched(self.model, [self.envs[i] for i in indices],
                                   [self.envs[i].forwards() for i in indices], self.kl_positions)
        self.model_calls += calls
        return [self.envs[i].first_observation(kl) for i, kl in zip(indices, kls, strict=True)]

    def _stack(self, observations: list[dict]) -> dict[str, np.ndarray]:
        return {key: np.stack([obs[key] for obs in observations]) for key in self.observation_space.spaces}

    # ------------------------------------------------------------------ VecEnv API
    def reset(self):
        self.closed = False
        started = self._start(list(range(self.num_envs)))
        self.reset_infos = [info for _, info in started]
        return self._stack([obs for obs, _ in started])

    def step_async(self, actions: np.ndarray) -> None:
        if self.closed:
            raise RuntimeError("step after close(): the envs' caches are released; call reset() first")
        if any(env.cache is None for env in self.envs):
            raise RuntimeError("call reset() before stepping the vector env")
        self._actions = check_action(actions, (self.num_envs, self.envs[0].num_candidates), "actions")

    @torch.no_grad()
    def step_wait(self):
        if self._actions is None:
            raise RuntimeError("step_async() must come before step_wait()")
        from kvgym.envs.observation import decode_action

        pending = []
        for env, action in zip(self.envs, self._actions, strict=True):
            decisions, illegal = decode_action(action, env._encoded)
            pending.append(env.apply(decisions, illegal))
        kls, calls = drive_batched(self.model, self.envs, [env.forwards() for env in self.envs], self.kl_positions)
        self.model_calls += calls
        observations, rewards, dones, infos = [], np.zeros(self.num_envs, np.float32), np.zeros(self.num_envs, bool), []
        for i, env in enumerate(self.envs):
            obs, reward, terminated, truncated, info = env.finish_step(kls[i], pending[i])
            self.episode_steps[i] += 1
            if not terminated and self.episode_steps[i] >= self.max_episode_steps:
                truncated = True
            info["TimeLimit.truncated"] = bool(truncated and not terminated)
            observations.append(obs)
            rewards[i], dones[i] = reward, terminated or truncated
            infos.append(info)
        ended = [i for i in range(self.num_envs) if dones[i]]
        if ended:
            for i, (obs, info) in zip(ended, self._start(ended), strict=True):
                infos[i]["terminal_observation"] = observations[i]
                observations[i] = obs
                self.reset_infos[i] = info
        self._actions = None
        return self._stack(observations), rewards, dones, infos

    def action_masks(self) -> np.ndarray:
        return np.stack([env.action_masks() for env in self.envs])

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.closed = True

    def seed(self, seed: int | None = None):
        self._seeds = [None if seed is None else seed + i for i in range(self.num_envs)]
        return self._seeds

    def _indices(self, indices):
        if indices is None:
            return range(self.num_envs)
        return [indices] if isinstance(indices, int) else indices

    def get_attr(self, attr_name: str, indices=None) -> list:
        return [getattr(self.envs[i], attr_name) for i in self._indices(indices)]

    def set_attr(self, attr_name: str, value, indices=None) -> None:
        for i in self._indices(indices):
            setattr(self.envs[i], attr_name, value)

    def env_method(self, method_name: str, *method_args, indices=None, **method_kwargs) -> list:
        return [getattr(self.envs[i], method_name)(*method_args, **method_kwargs) for i in self._indices(indices)]

    def env_is_wrapped(self, wrapper_class, indices=None) -> list[bool]:
        return [False for _ in self._indices(indices)]

    def get_images(self):
        return [env.render() for env in self.envs]


class PagedKVCacheVectorEnv(gym.vector.VectorEnv):
    """Gymnasium ``VectorEnv`` of live episodes with batched forwards (same-step autoreset: ``infos["final_obs"]``
    and ``infos["final_info"]`` hold the ended episodes' last observation and info). Arguments as
    ``PagedKVCacheVecEnv``; registered as the ``vector_entry_point`` of ``kvgym/PagedKVCache-v0``."""

    metadata = {"render_modes": ["ansi", "rgb_array"], "autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int = 2, max_episode_steps: int = 4096, **kwargs):
        self.vec = PagedKVCacheVecEnv(num_envs, max_episode_steps=max_episode_steps, **kwargs)
        self.num_envs = num_envs
        self.single_observation_space = self.vec.observation_space
        self.single_action_space = self.vec.action_space
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.render_mode = kwargs.get("render_mode")

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        if isinstance(seed, int):
            self.vec.seed(seed)
        elif seed is not None:
            self.vec._seeds = list(seed)
        observations = self.vec.reset()
        infos: dict = {}
        for i, info in enumerate(self.vec.reset_infos):
            infos = self._add_info(infos, info, i)
        return observations, infos

    def step(self, actions):
        self.vec.step_async(actions)
        observations, rewards, dones, step_infos = self.vec.step_wait()
        terminated = np.array([d and not info["TimeLimit.truncated"] for d, info in zip(dones, step_infos, strict=True)])
        truncated = dones & ~terminated
        infos: dict = {}
        for i, info in enumerate(step_infos):
            info = dict(info)
            final = info.pop("terminal_observation", None)
            if final is not None:
                infos = self._add_info(infos, {"final_obs": final, "final_info": dict(info)}, i)
            infos = self._add_info(infos, info, i)
        return observations, rewards.astype(np.float64), terminated, truncated, infos

    def action_masks(self) -> np.ndarray:
        return self.vec.action_masks()

    def close_extras(self, **kwargs):
        self.vec.close()


def steps_per_second(env, steps: int, seed: int = 0) -> dict:
    """Random legal actions for ``steps`` steps on a single env or a ``PagedKVCacheVecEnv``; env steps per
    second (a vector step counts ``num_envs``)."""
    rng = np.random.default_rng(seed)
    vector = isinstance(env, VecEnv)
    if vector:
        env.seed(seed)
        env.reset()
    else:
        env.reset(seed=seed)
    start, count = time.perf_counter(), 0
    while count < steps:
        masks = env.action_masks().reshape(env.num_envs if vector else 1, -1, 4)
        actions = np.argmax(rng.random(masks.shape) * masks, axis=2)  # a uniformly random legal op per slot
        if vector:
            env.step_async(actions)
            env.step_wait()
            count += env.num_envs
        else:
            *_, terminated, truncated, _ = env.step(actions[0])
            count += 1
            if terminated or truncated:
                env.reset()
    seconds = time.perf_counter() - start
    return {"steps": count, "seconds": seconds, "steps_per_s": count / seconds}
