"""``kvgym/KVCache-v1``: the live cache on the ranking action, one sample per episode, one decision point per step.

An **episode** runs one sample live in its protocol (``cache.runner``: ``streaming``, ``multiturn``, or the one-shot
protocols as one-step episodes). A **step** is one decision point of that run (each streamed prefill chunk, the
question, every ``decide_every`` decode steps, each later turn), for **all layers at once**: what the policy drops
stays dropped, a block it moves costs bytes, what it keeps for one turn is what the next can use.

- **Observation** (``Dict``): ``blocks`` ``[L, N, F]``, every block's ranking features (``cache.ranking``,
  the shipped ranker's inputs; zero past the cache's ``n`` blocks), ``mask`` ``[L, N]`` (1 for a block that exists
  and is not dropped), ``layers`` ``[L, 5]`` (device pressure, budget as a share of the layer's blocks, and the
  shares of its blocks on device / host / disk), ``globals`` (the phase one-hot, question read, progress through
  the prompt and answer, the budget fraction, MB moved between tiers so far). ``N`` is fixed by ``max_tokens``.
- **Action** ``[L, N, 2]`` in ``[-1, 1]``: a keep score and a merge logit per block. Each layer keeps its pinned
  blocks and its highest-scoring ones up to its budget (``keep_top``: evictions, merges where the logit is > 0,
  prefetches), so the budget always holds and the cache's fallback never fires. With ``budget_scope="global"``
  only the total over layers holds: the highest scores over all layers stay, so the policy decides how many
  blocks each layer keeps (issue 39's global budget). A score policy with unbounded
  outputs maps them with any increasing squash (``squash``: ``x / (1 + |x|)``) without changing its choices.
- **Reward**: per step, minus ``kl_weight`` times the KL(full cache || this cache) of each answer token decoded
  since the previous decision, on the tokens the full cache also produced (a position counts while the answer so
  far equals the full cache's; after the two diverge the task score speaks for them), minus ``transfer_cost``
  per MB moved between tiers in the step (one number for every tier pair, or one per pair: ``bandwidth_costs``
  derives them from a stated PCIe / disk bandwidth model); at the end, plus the task score (the mean over turns).

The run itself is ``cache.runner.Runner``'s generator (``Runner.steps``) with the controller ``EXTERNAL``: it
yields each forward it needs and each decision point, and the env answers the forwards and hands the decision
points to the agent, so the env follows every protocol exactly as ``kvgym eval`` runs it. ``KVCacheVectorEnv``
(``gym.make_vec("kvgym/KVCache-v1", num_envs=N)``) steps N such episodes on one model, their forwards batched
(``cache.driving.serve_forwards``). The full cache's run of each sample (the reference of the KL) is made once and
kept for a few samples.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from cache.controller import PHASES, CacheView
from cache.driving import EXTERNAL, Decide, Finished, send_to, serve_forwards
from cache.models import model_with_tokenizer
from cache.paged_cache import CacheConfig
from cache.ranking import NUM_RANK_FEATURES, RANK_FEATURES, keep_top, policy_features
from cache.runner import BUDGET_SCOPES, PROTOCOLS, Runner
from cache.sentences import sentence_end_token_ids
from cache.tiers import Tier

VALID_COLUMN = RANK_FEATURES.index("valid")
LAYER_COLUMNS = ("pressure", "budget_share", "device_share", "host_share", "disk_share")
GLOBAL_COLUMNS = (*[f"phase_{phase}" for phase in PHASES], "question_read", "progress", "budget", "mb_moved")
REFERENCES_KEPT = 8


def squash(scores: np.ndarray) -> np.ndarray:
    """An increasing map of real scores into ``(-1, 1)``: the same top-b, in the action space's bounds."""
    scores = np.asarray(scores, np.float64)
    return (scores / (1.0 + np.abs(scores))).astype(np.float32)


TIER_PAIRS = ("device->host", "host->device", "device->disk", "disk->device", "host->disk", "disk->host")


def bandwidth_costs(per_ms: float, pcie_gb_per_s: float = 25.0, disk_gb_per_s: float = 3.0) -> dict[str, float]:
    """``transfer_cost`` per tier pair from a bandwidth model: ``per_ms`` of reward per millisecond of transfer, a
    PCIe link between device and host (25 GB/s: PCIe 4.0 x16) and a disk link (3 GB/s: an NVMe drive) for anything
    that touches the disk. A MB over a link of B GB/s takes 1 / B ms."""
    cost = {}
    for pair in TIER_PAIRS:
        speed = disk_gb_per_s if "disk" in pair else pcie_gb_per_s
        cost[pair] = per_ms / speed
    return cost


def transfer_costs(transfer_cost: float | dict, **weights: float) -> dict[str, float]:
    """``transfer_cost`` (one number, or one per tier pair of ``TIER_PAIRS``) as a cost per pair, checked with the
    other reward ``weights`` (each a finite number >= 0); a ``ValueError`` naming what is wrong otherwise."""
    costs = transfer_cost if isinstance(transfer_cost, dict) else dict.fromkeys(TIER_PAIRS, transfer_cost)
    unknown = sorted(set(costs) - set(TIER_PAIRS))
    if unknown:
        raise ValueError(f"transfer_cost: unknown tier pairs {unknown}; the pairs are {', '.join(TIER_PAIRS)}")
    for name, value in [*((f"transfer_cost {pair}", c) for pair, c in costs.items()), *weights.items()]:
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} {value!r}: must be a finite number >= 0")
    return {pair: float(c) for pair, c in costs.items()}


def spaces_of(num_layers: int, max_blocks: int) -> tuple[spaces.Dict, spaces.Box]:
    """The observation and action spaces of ``KVCache-v1`` and its replay twin for a model and block axis."""
    shape = (num_layers, max_blocks)
    observation = spaces.Dict({
        "blocks": spaces.Box(-np.inf, np.inf, (*shape, NUM_RANK_FEATURES), np.float32),
        "mask": spaces.Box(0.0, 1.0, shape, np.float32),
        "layers": spaces.Box(-np.inf, np.inf, (num_layers, len(LAYER_COLUMNS)), np.float32),
        "globals": spaces.Box(-np.inf, np.inf, (len(GLOBAL_COLUMNS),), np.float32),
    })
    return observation, spaces.Box(-1.0, 1.0, (*shape, 2), np.float32)


def checked_action(action, space: spaces.Box) -> np.ndarray:
    """``action`` as float32 of ``space``'s shape, finite; a ``ValueError`` that shows what came instead."""
    action = np.asarray(action, np.float32)
    finite = bool(np.isfinite(action).all())
    if action.shape != space.shape or not finite:
        raise ValueError(f"action: expected finite values of shape {space.shape}, got {action.shape}"
                         + ("" if finite else " with NaN or inf"))
    return action


def _mb_moved(cache, cost: dict[str, float]) -> tuple[float, float]:
    """MB moved between tiers so far, every direction, and their cost (``cost`` per MB of each tier pair)."""
    mb = {f"{a}->{b}": n / 1e6 for (a, b), n in cache.bytes_moved.items()}
    return sum(mb.values()), sum(cost.get(pair, 0.0) * value for pair, value in mb.items())


class KVCacheEnv(gym.Env):
    """See the module docstring."""

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, model="smollm2-135m", tokenizer=None, tasks=("families_train",), lengths=(2048,),
                 protocol: str = "streaming", budget_range=(0.125, 0.5), host_blocks: int = 0, block_size: int = 16,
                 prefill_chunk: int = 64, decide_every: int = 8, max_new_tokens: int | None = None,
                 max_tokens: int | None = None, transfer_cost: float | dict = 0.0, kl_weight: float = 1.0,
                 budget_scope: str = "layer", chat: bool = False, render_mode: str | None = None):
        from eval.tasks.base import get_task

        if isinstance(tasks, str):
            tasks = [task.strip() for task in tasks.split(",") if task.strip()]
        tasks, lengths = list(tasks), [int(length) for length in lengths]
        if not tasks or not lengths or min(lengths) < 1:
            raise ValueError(f"tasks {tasks!r} and lengths {lengths!r}: give at least one task and positive lengths")
        self.generators = {task: get_task(task) for task in tasks}  # an unknown task is refused before loading
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        if budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"budget_scope {budget_scope!r}: choose one of {', '.join(BUDGET_SCOPES)}")
        low, high = budget_range
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"budget_range {budget_range!r}: need 0 < low <= high <= 1")
        for name, value in (("block_size", block_size), ("prefill_chunk", prefill_chunk),
                            ("decide_every", decide_every), ("max_new_tokens", max_new_tokens or 1),
                            ("max_tokens", max_tokens or 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r}: must be a positive integer")
        if host_blocks < 0:
            raise ValueError(f"host_blocks {host_blocks!r}: must be >= 0")
        costs = transfer_costs(transfer_cost, kl_weight=kl_weight)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r}: use one of {self.metadata['render_modes']}")
        model, tokenizer = model_with_tokenizer(model, tokenizer)
        self.model, self.tokenizer, self.chat, self.render_mode = model, tokenizer, chat, render_mode
        self.tasks, self.lengths, self.protocol, self.budget_range = tasks, lengths, protocol, (low, high)
        self.budget_scope = budget_scope
        self.cache_config = CacheConfig(block_size=block_size, host_blocks=host_blocks)
        self.prefill_chunk, self.decide_every, self.max_new_tokens = prefill_chunk, decide_every, max_new_tokens
        self.transfer_cost, self.kl_weight = costs, float(kl_weight)
        self.max_tokens = max_tokens or int(1.25 * max(lengths)) + 256
        self.num_layers, self.max_blocks = model.config.num_hidden_layers, math.ceil(self.max_tokens / block_size)
        self.observation_space, self.action_space = spaces_of(self.num_layers, self.max_blocks)
        # the vocabulary scan for sentence ends (a view feature), once (a tokenizer without a vocabulary: none)
        self._sentence_end_ids = sentence_end_token_ids(tokenizer) if hasattr(tokenizer, "get_vocab") else None
        self._references: OrderedDict = OrderedDict()
        self._steps = None  # the running episode's generator (Runner.steps); None between episodes
        self._view: CacheView | None = None
        self.last_result = None  # the last finished episode's RunResult (text, bytes moved per tier pair, ...)

    # ------------------------------------------------------------------ episode plumbing
    def _reference(self, key, prompt, max_new_tokens: int) -> dict:
        """The full cache's answer tokens and next-token logits per (turn, step), made once per sample."""
        if key not in self._references:
            logits, tokens = {}, {}

            def keep(turn, step, step_logits, token):
                logits[turn, step] = step_logits.detach().float().cpu()
                tokens.setdefault(turn, []).append(token)

            self._runner(None, None).run(prompt, max_new_tokens=max_new_tokens, on_token=keep)
            self._references[key] = {"logits": logits, "tokens": tokens}
            while len(self._references) > REFERENCES_KEPT:
                self._references.popitem(last=False)
        self._references.move_to_end(key)
        return self._references[key]

    def _runner(self, controller, budget) -> Runner:
        runner = Runner(self.model, None, self.cache_config, controller=controller, budget=budget,
                        prefill_chunk=self.prefill_chunk, decide_every=self.decide_every, protocol=self.protocol,
                        budget_scope=self.budget_scope if controller is not None else None)
        runner.tokenizer, runner.sentence_end_ids = self.tokenizer, self._sentence_end_ids
        return runner

    def _on_token(self, turn: int, step: int, logits: torch.Tensor, token: int) -> None:
        """Worker thread: the KL of this answer position while everything before it is the full cache's."""
        reference = self._ref["tokens"]
        if step == 0 and turn > 0:  # a later turn sees the previous answers: they must be the reference's too
            self._agrees = self._agrees and self._answer.get(turn - 1) == reference.get(turn - 1)
        answer = self._answer.setdefault(turn, [])
        agrees = self._agrees and answer == reference.get(turn, [])[:step] and (turn, step) in self._ref["logits"]
        if agrees:
            log_p = torch.log_softmax(self._ref["logits"][turn, step].double(), dim=-1)
            log_q = torch.log_softmax(logits.detach().double().cpu(), dim=-1)
            self._pending_kl += float((log_p.exp() * (log_p - log_q)).sum().clamp_min(0.0))
            self._kl_positions += 1
        else:
            self._agrees = False
        answer.append(int(token))

    def _send(self, value):
        """The run's next request after ``value`` (None: its start): a ``Forward``, a ``Decide`` or ``Finished``."""
        try:
            return send_to(self._steps, value)
        except Exception:
            self._steps = None
            raise

    def _advance(self, value):
        """Send ``value``, answer the run's forwards, return its next ``Decide`` or ``Finished`` (the vector env's
        ``serve_forwards`` with one run)."""
        return serve_forwards({0: self._send(value)}, lambda _, logits: self._send(logits))[0]

    def _stop(self) -> None:
        """Abandon the running episode (a reset before it ended, or close)."""
        if self._steps is not None:
            self._steps.close()
            self._steps = None
            if self._view is not None:
                self._view.cache.close()

    def _observation(self, view: CacheView) -> dict:
        n = view.num_blocks
        if n > self.max_blocks:
            raise RuntimeError(f"the cache holds {n} blocks, more than the observation's {self.max_blocks} "
                               f"(max_tokens {self.max_tokens}): make the env with a larger max_tokens")
        blocks = np.zeros(self.observation_space["blocks"].shape, np.float32)
        blocks[:, :n] = policy_features(view)
        mask = np.zeros(self.observation_space["mask"].shape, np.float32)
        mask[:, :n] = blocks[:, :n, VALID_COLUMN] > 0
        tier = view.tier.numpy()
        existing = np.maximum((tier != Tier.DROPPED).sum(axis=1), 1)
        layers = np.stack([view.pressure.numpy(), view.budget_blocks.numpy() / existing,
                           *[(tier == t).sum(axis=1) / existing for t in (Tier.DEVICE, Tier.HOST, Tier.DISK)]],
                          axis=1).astype(np.float32)
        phase = [float(view.phase == p) for p in PHASES]
        progress = view.seen / max(self._total_tokens, 1)
        moved = _mb_moved(view.cache, self.transfer_cost)[0]
        glob = np.array([*phase, float(view.question_read), progress, self._budget, moved], np.float32)
        return {"blocks": blocks, "mask": mask, "layers": layers, "globals": glob}

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        info = self._start(options)
        return self._first(self._advance(None), info), info

    def _start(self, options: dict | None) -> dict:
        """Draw the episode's sample (``options`` as ``reset``'s), make its reference, and start its run (nothing
        is fed yet); returns the reset info."""
        from eval.tasks.prompt import build_prompt

        self._stop()
        self._view = None
        options = dict(options or {})
        unknown = sorted(set(options) - {"task", "length", "budget", "sample_seed", "index"})
        if unknown:
            raise ValueError(f"reset options {unknown}: the options are task, length, budget, sample_seed, index")
        task = options.get("task", self.tasks[int(self.np_random.integers(len(self.tasks)))])
        length = int(options.get("length", self.lengths[int(self.np_random.integers(len(self.lengths)))]))
        budget = float(options.get("budget", self.np_random.uniform(*self.budget_range)))
        sample_seed = int(options.get("sample_seed", self.np_random.integers(2**31)))
        if task not in self.generators:
            raise ValueError(f"reset option task {task!r}: this env draws from {', '.join(self.tasks)}")
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"reset option budget {budget!r}: a fraction in (0, 1]")
        index = int(options.get("index", 0))  # with sample_seed: kvgym eval's sample (eval.tasks.base.sample_seed)
        sample = self.generators[task](self.tokenizer, length, sample_seed, index)
        prompt = build_prompt(self.tokenizer, sample, self.chat)
        max_new = self.max_new_tokens or sample.max_new_tokens
        turns = len(prompt.turns) + 1
        self._total_tokens = len(prompt.ids) + sum(len(t) for t in prompt.turns) + turns * max_new
        if self._total_tokens > self.max_tokens:
            raise ValueError(f"sample {task}/{length}/{sample_seed}: {self._total_tokens} tokens with its answers, over "
                             f"max_tokens {self.max_tokens}: make the env with a larger max_tokens")
        self._sample, self._budget = sample, budget
        self._ref = self._reference((task, length, sample_seed, index, self.chat), prompt, max_new)
        self._answer, self._agrees, self._pending_kl, self._kl_positions = {}, True, 0.0, 0
        self._moved_mb = self._moved_cost = 0.0
        self._steps = self._runner(EXTERNAL, budget).steps(prompt, max_new_tokens=max_new, on_token=self._on_token)
        return {"task": task, "length": length, "budget": budget, "sample_seed": sample_seed, "index": index,
                "prompt_tokens": len(prompt.ids), "turns": turns}

    def _first(self, request, info: dict) -> dict:
        """The first observation of an episode whose run reached ``request``."""
        if not isinstance(request, Decide):
            self._steps = None
            raise RuntimeError(f"sample {info['task']}/{info['length']}/{info['sample_seed']} ran without a decision "
                               f"point at budget {info['budget']}")
        self._view = request.view
        return self._observation(request.view)

    def _placement(self, action):
        """The action as the decision the run applies (``keep_top`` on the current view)."""
        if self._steps is None:
            raise gym.error.ResetNeeded("step() before reset() or after the episode ended: call reset()")
        action = checked_action(action, self.action_space)
        self._pending_kl = 0.0
        n = self._view.num_blocks
        return keep_top(self._view, action[:, :n, 0], action[:, :n, 1])

    def step(self, action):
        return self._outcome(self._advance(self._placement(action)))

    def _outcome(self, request):
        """``step``'s return once the run reached ``request`` (its next ``Decide``, or ``Finished``)."""
        result = request.result if isinstance(request, Finished) else None
        moved, cost = _mb_moved((request.view if result is None else result).cache, self.transfer_cost)
        step_mb, step_cost = moved - self._moved_mb, cost - self._moved_cost
        self._moved_mb, self._moved_cost = moved, cost
        reward = -self.kl_weight * self._pending_kl - step_cost
        info = {"kl": self._pending_kl, "mb_moved": step_mb, "transfer_cost": step_cost}
        if result is None:
            self._view = request.view
            return self._observation(request.view), float(reward), False, False, info
        self._steps = None
        result.cache.close()  # the run's cache is done with; its byte counts stay in result.bytes_moved
        result.cache, self.last_result = None, result
        score = self._score(result)
        info.update(score=score, text=result.text, fallbacks=result.fallbacks, decisions=result.decisions,
                    kl_positions=self._kl_positions)
        return self._observation(self._view), float(reward + score), True, False, info

    def _score(self, result) -> float:
        from eval.tasks.scoring import score

        sample = self._sample
        answers = [sample.outputs] + [turn.outputs for turn in sample.turns]
        texts = result.turn_texts or [result.text]
        return float(np.mean([score({"metric": sample.metric, "outputs": gold, "task": sample.task}, text or "")
                              for gold, text in zip(answers, texts, strict=False)]))

    def render(self):
        if self._view is None:
            raise gym.error.ResetNeeded("render() before reset(): call env.reset() first, there is no cache to show")
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode='ansi'")
            return None
        symbols = {int(Tier.DEVICE): "D", int(Tier.HOST): "h", int(Tier.DISK): "d", int(Tier.DROPPED): "."}
        tiers = self._view.tier
        return "\n".join(f"L{layer:02d} " + "".join(symbols.get(int(t), "?") for t in tiers[layer])
                         for layer in range(tiers.shape[0]))

    def close(self):
        self._stop()
        super().close()


class KVCacheVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` ``KVCacheEnv`` episodes on one model, stepped together: at each step every episode's run goes to
    its next decision point, and the forwards they need on the way go through the model in batches (those of the
    same length in one batched forward: ``cache.driving.serve_forwards``). Each sub-episode sees, does and earns what
    it would alone (to float rounding). Episodes reset themselves on the step after they end (gymnasium's
    next-step autoreset: that step's action for them is ignored). ``gym.make_vec("kvgym/KVCache-v1", num_envs=N,
    vectorization_mode="vector_entry_point", **env_kwargs)`` makes one."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(self, num_envs: int = 2, model="smollm2-135m", tokenizer=None, max_episode_steps: int | None = None,
                 **env_kwargs):
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs {num_envs!r}: must be a positive integer")
        self.max_episode_steps = max_episode_steps  # an episode that reaches it is truncated (the registration's)
        model, tokenizer = model_with_tokenizer(model, tokenizer)
        self.envs = [KVCacheEnv(model, tokenizer, **env_kwargs) for _ in range(num_envs)]
        self.num_envs = num_envs
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self._ended = np.zeros(num_envs, bool)
        self._lengths = np.zeros(num_envs, int)
        self._started = False

    def _run_to_decisions(self, sends: dict[int, object]) -> dict[int, object]:
        """Send each episode its value (None: its start) and serve every forward, batched, until each episode is
        at its next ``Decide`` or ``Finished``."""
        requests = {index: self.envs[index]._send(value) for index, value in sends.items()}
        return serve_forwards(requests, lambda index, logits: self.envs[index]._send(logits))

    def _options(self, options, index):
        return options[index] if isinstance(options, (list, tuple)) else options

    def reset(self, *, seed: int | list[int] | None = None, options: dict | list[dict] | None = None):
        seeds = seed if isinstance(seed, (list, tuple)) else [None if seed is None else seed + i
                                                               for i in range(self.num_envs)]
        infos, starts = {}, {}
        for index, env in enumerate(self.envs):
            gym.Env.reset(env, seed=seeds[index])
            starts[index] = env._start(self._options(options, index))
        requests = self._run_to_decisions(dict.fromkeys(range(self.num_envs)))
        observations = []
        for index, env in enumerate(self.envs):
            observations.append(env._first(requests[index], starts[index]))
            infos = self._add_info(infos, starts[index], index)
        self._ended[:] = False
        self._lengths[:] = 0
        self._started = True
        return self._stack(observations), infos

    def step(self, actions):
        if not self._started:
            raise gym.error.ResetNeeded("step() before reset(): call reset() first")
        actions = np.asarray(actions, np.float32)
        if actions.shape != self.action_space.shape:
            raise ValueError(f"actions: expected shape {self.action_space.shape} (num_envs, ...), got {actions.shape}")
        sends, fresh = {}, {}
        for index, env in enumerate(self.envs):
            if self._ended[index]:  # next-step autoreset: the episode starts again, the action is ignored
                fresh[index] = env._start(None)
                sends[index] = None
                self._lengths[index] = 0
            else:
                sends[index] = env._placement(actions[index])
                self._lengths[index] += 1
        requests = self._run_to_decisions(sends)
        observations, infos = [], {}
        rewards = np.zeros(self.num_envs)
        terminations = np.zeros(self.num_envs, bool)
        for index, env in enumerate(self.envs):
            if index in fresh:
                observations.append(env._first(requests[index], fresh[index]))
                info = fresh[index]
            else:
                observation, rewards[index], terminations[index], _, info = env._outcome(requests[index])
                observations.append(observation)
            infos = self._add_info(infos, info, index)
        truncations = ~terminations & (self._lengths >= (self.max_episode_steps or np.inf))
        for index in np.flatnonzero(truncations):
            self.envs[index]._stop()
        self._ended = terminations | truncations
        return self._stack(observations), rewards, terminations, truncations, infos

    def _stack(self, observations: list[dict]) -> dict:
        return {key: np.stack([o[key] for o in observations]) for key in self.single_observation_space.spaces}

    def close_extras(self, **kwargs):
        for env in self.envs:
            env.close()
