"""The Gymnasium environment over the live paged KV cache."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from cache.controller import CacheView, Op, apply_decisions
from cache.models import model_with_tokenizer
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.runner import budget_blocks
from cache.tiers import Tier
from kvgym.envs.observation import (
    FALLBACK_RULE,
    Encoded,
    action_space,
    decode_action,
    encode,
    observation_space,
)
from kvgym.envs.reward import reward, reward_terms


@dataclass
class Reference:
    """The full cache's run of one task sample, computed once and reused: its greedy tokens, and its next-token
    log-probabilities after each prompt chunk and after feeding each of its tokens."""

    prompt_ids: list[int]
    prefill_logprobs: list[torch.Tensor]  # per prefill chunk: [positions, vocab] at its last kl_positions
    decode_logprobs: torch.Tensor  # [steps, vocab]: row s after feeding tokens[s]
    tokens: list[int]  # the full cache's greedy continuation; the env feeds exactly these (teacher forcing)


def drive(forwards, forward) -> float:
    """Run a ``forwards`` generator to its end with ``forward(ids) -> logits``; returns its value (the KL)."""
    try:
        ids = next(forwards)
        while True:
            ids = forwards.send(forward(ids))
    except StopIteration as stop:
        return stop.value


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Sum over positions of KL(reference || softmax(logits)); ``reference`` holds log-probabilities."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return float((reference.exp() * (reference - logprobs)).sum())


def check_action(action, shape: tuple[int, ...], what: str = "action") -> np.ndarray:
    """``action`` as an int64 array of ``shape`` whose entries are ops (0 keep, 1 evict, 2 merge, 3 prefetch);
    a ``ValueError`` naming the action and what is accepted otherwise."""
    ops = ", ".join(f"{int(op)} {op.name.lower()}" for op in Op)
    expected = f"an integer array of shape {shape} with entries {ops}"
    try:
        array = np.asarray(action)
    except ValueError:  # ragged nested lists
        raise ValueError(f"{what} {action!r}: expected {expected}") from None
    if array.shape != shape:
        raise ValueError(f"{what} of shape {array.shape}: expected {expected}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} of dtype {array.dtype}: expected {expected}")
    if array.size and (array.min() < 0 or array.max() >= len(Op)):
        raise ValueError(f"{what} {array.tolist()}: expected {expected}")
    return array.astype(np.int64, copy=False)


class PagedKVCacheEnv(gym.Env):
    """
    ## Description

    A live, paged KV cache decoding a Llama-family model on a long-horizon task. At each decision point the
    agent sees up to ``K`` candidate blocks (offloaded blocks most similar to the current query, and the device
    blocks the fallback would evict next) and chooses an operation for each. After its choice the cache
    enforces every layer's device budget with a fallback rule (H2O's split: the newest ``budget // 2`` blocks
    are a protected recent window, the others go by lowest accumulated attention), counted in
    ``info["fallbacks"]``. Decision points: after every prefill chunk, every ``decide_every`` decode steps, and
    whenever a layer goes over its budget.

    ## Action Space

    ``MultiDiscrete([4] * K)``: per candidate slot, 0 keep, 1 evict (to host, else disk, else dropped),
    2 merge (fold into the most similar kept tokens), 3 prefetch (host/disk → device). Masks come from
    ``action_masks()`` (flat ``[K * 4]`` bool, for sb3-contrib) and ``info["action_mask"]`` (``[K, 4]``
    int8); keep is always legal; a masked op is ignored (acts as keep) and counted in ``info["illegal_ops"]``.

    ## Observation Space

    ``Dict`` of flat float32 boxes:

    | key | shape | content |
    |---|---|---|
    | `layer_pressure` | (L,) | device blocks / budget, per layer |
    | `tier_occupancy` | (3,) | used / capacity of the device, host, disk pools |
    | `blocks` | (K * 12,) | per slot: valid, layer depth, age, log1p acc. mass, log1p recent mass, similarity to the query summary, similarity to the nearest neighbour, tier one-hot (3), sentence boundary, pinned |
    | `globals` | (3,) | progress (tokens processed / total), budget fraction, bytes moved / full-cache bytes |

    ## Rewards

    ``kvgym.envs.reward``: per step, ``-(KL)`` summed over the step's scored tokens, where KL is between the
    full cache's and this cache's next-token distributions (prefill: the last ``kl_positions`` positions of each
    chunk; decode: every step), ``- lambda_bytes`` × MB moved between tiers, and at the end ``+ lambda_task`` ×
    the task score of the answer. Components are in ``info`` (``kl``, ``bytes_moved``, ``task_score``, and the
    signed ``reward_terms``). The full-cache reference is computed once per sample and cached.

    Decoding is teacher-forced: the env's cache is fed the full cache's own greedy tokens
    (``Reference.tokens``), so the KL of every step compares the two caches on the same prefix, and a step's KL
    depends only on what this cache holds, never on a token it picked earlier. The answer scored at the end is
    this cache's greedy pick at each answer position given the reference's prefix (``info``'s ``generated``
    tokens, cut at the first EOS): exact where the cache agrees with the full cache, wrong where it does not,
    but an early mistake does not derail the positions after it. The episode ends where the reference's
    answer ends (``max_new_tokens`` or its EOS), as in the replay env.

    ## Starting State

    A task sample drawn with the env's RNG from ``tasks`` × ``lengths``, a budget fraction drawn uniformly
    from ``budget_range``; the first prefill chunk has been processed.

    ## Episode End

    ``terminated`` when the reference's answer has been fed (``max_new_tokens`` or the reference's EOS);
    ``truncated`` only by a ``TimeLimit`` wrapper (``gym.make`` adds one).

    ## Arguments

    ``model``/``tokenizer`` (objects, or ``model`` as a name for ``cache.models.load_model``), ``tasks``,
    ``lengths``, ``budget_range``, ``num_candidates`` (K, 32), ``prefill_chunk`` (64), ``decide_every`` (8),
    ``max_new_tokens`` (None: the sample's), ``kl_positions`` (8), ``lambda_bytes`` (0.01 per MB),
    ``lambda_task`` (1.0), ``host_blocks`` (None: room for the whole context), ``chat`` (False),
    ``render_mode`` (``"ansi"`` | ``"rgb_array"``).

    ## Version History

    * v0: initial version (live mode). ``gym.make_vec(..., vectorization_mode="vector_entry_point")`` gives the
      batched vector env (``kvgym.envs.vector``: one model, one batched forward per step for N episodes).
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}

    def __init__(self, model="smollm2-135m", tokenizer=None, tasks=("passkey",), lengths=(1024,),
                 budget_range=(0.125, 0.5), num_candidates: int = 32, prefill_chunk: int = 64,
                 decide_every: int = 8, max_new_tokens: int | None = None, kl_positions: int = 8,
                 lambda_bytes: float = 0.01, lambda_task: float = 1.0, host_blocks: int | None = None,
                 chat: bool = False, render_mode: str | None = None):
        from eval.tasks.base import get_task

        if isinstance(tasks, str):  # one name, or several separated by commas (as on the command line)
            tasks = [task.strip() for task in tasks.split(",") if task.strip()]
        tasks = list(tasks)
        if not tasks:
            raise ValueError("tasks: the list is empty; give at least one task name (e.g. ('passkey',))")
        generators = {task: get_task(task) for task in tasks}  # an unknown name is refused before the model loads
        for name, value in (("decide_every", decide_every), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r}: must be a positive integer (tokens between decisions)")
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens {max_new_tokens!r}: must be a positive integer or None (the task's own)")
        low, high = budget_range
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"budget_range {budget_range!r}: need 0 < low <= high <= 1")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r}: use one of {self.metadata['render_modes']}")
        model, tokenizer = model_with_tokenizer(model, tokenizer)
        self.generators = generators
        self.model, self.tokenizer = model, tokenizer
        self.tasks, self.lengths, self.budget_range = list(tasks), list(lengths), (low, high)
        self.num_candidates, self.prefill_chunk, self.decide_every = num_candidates, prefill_chunk, decide_every
        self.max_new_tokens, self.kl_positions = max_new_tokens, kl_positions
        self.lambda_bytes, self.lambda_task = lambda_bytes, lambda_task
        self.host_blocks, self.chat, self.render_mode = host_blocks, chat, render_mode
        self.num_layers = model.config.num_hidden_layers
        self.observation_space = observation_space(self.num_layers, num_candidates)
        self.action_space = action_space(num_candidates)
        self._references: OrderedDict = OrderedDict()
        self.cache: PagedKVCache | None = None
        self._encoded: Encoded | None = None
        self.closed = False

    # ------------------------------------------------------------------ episode plumbing
    def _prompt_ids(self, sample) -> list[int]:
        from eval.tasks.prompt import build_prompt

        return build_prompt(self.tokenizer, sample, self.chat).ids

    @torch.no_grad()
    def _reference(self, key, prompt_ids: list[int], new_tokens: int) -> Reference:
        if key in self._references:
            self._references.move_to_end(key)
            return self._references[key]
        cache = PagedKVCache(self.model.config, CacheConfig(max_tokens=len(prompt_ids) + new_tokens + 1))
        ids = torch.tensor([prompt_ids])
        prefill = []
        for start in range(0, len(prompt_ids), self.prefill_chunk):
            out = self.model(input_ids=ids[:, start : start + self.prefill_chunk], cache=cache, use_cache=True,
                             logits_to_keep=self.kl_positions)
            prefill.append(torch.log_softmax(out.logits[0].float(), dim=-1))
        token = int(prefill[-1][-1].argmax())
        tokens, decode = [], []
        for _ in range(new_tokens):
            tokens.append(token)
            out = self.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            decode.append(torch.log_softmax(out.logits[0, -1].float(), dim=-1))
            token = int(decode[-1].argmax())
        reference = Reference(prompt_ids, prefill, torch.stack(decode) if decode else torch.empty(0), tokens)
        self._references[key] = reference
        while len(self._references) > 4:
            self._references.popitem(last=False)
        return reference

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.start_episode(seed)
        kl = self._advance()
        return self.first_observation(kl)

    def start_episode(self, seed: int | None = None) -> None:
        """Draw the sample and budget and set up the cache; the first prefill chunk is ``forwards``' job."""
        super().reset(seed=seed)
        if self.cache is not None:
            self.cache.close()
        self.closed = False
        rng = self.np_random
        task = self.tasks[int(rng.integers(len(self.tasks)))]
        length = self.lengths[int(rng.integers(len(self.lengths)))]
        sample_seed = int(rng.integers(2**31 - 1))
        self.sample = self.generators[task](self.tokenizer, length, sample_seed, 0)
        self.budget_fraction = float(rng.uniform(*self.budget_range))
        self.prompt_ids = self._prompt_ids(self.sample)
        self.new_tokens = self.max_new_tokens or self.sample.max_new_tokens
        total = len(self.prompt_ids) + self.new_tokens
        if total > self.model.config.max_position_embeddings:
            raise ValueError(f"task {task} at length {length} needs {total} positions; the model has "
                             f"{self.model.config.max_position_embeddings}")
        self.reference = self._reference((task, length, sample_seed), self.prompt_ids, self.new_tokens)
        blocks_total = -(-total // 16)
        host = self.host_blocks if self.host_blocks is not None else blocks_total
        self.cache = PagedKVCache(self.model.config, CacheConfig(max_tokens=total + 1, host_blocks=host))
        self.budget = budget_blocks(self.budget_fraction, total, 16, self.num_layers, 2)
        self.total_tokens = total
        self.chunk_index, self.generated, self.done = 0, [], False
        self.next_token: int | None = None
        self.bytes_moved_total = 0

    def first_observation(self, kl: float):
        """``reset``'s return value, once the first prefill chunk has run."""
        return self._observe(), self._info(kl=kl, bytes_moved=0, fallbacks=0, task_score=0.0, ops={},
                                           within_budget=True, illegal_ops=0)

    @torch.no_grad()
    def _advance(self) -> float:
        """Run to the next decision point; returns the KL accumulated on the way."""
        return drive(self.forwards(), lambda ids: self.model(input_ids=ids, cache=self.cache, use_cache=True,
                                                               logits_to_keep=self.kl_positions).logits[0])

    def forwards(self):
        """The forward passes to the next decision point, as a generator: yields the input ids ``[1, q]`` of
        each forward and receives its logits ``[min(q, kl_positions), vocab]``; returns the KL accumulated.
        ``_advance`` drives it with one model call per forward; ``PagedKVCacheVecEnv`` drives N of them with
        one batched model call per forward."""
        kl = 0.0
        if self.chunk_index * self.prefill_chunk < len(self.prompt_ids):
            start = self.chunk_index * self.prefill_chunk
            logits = yield torch.tensor([self.prompt_ids[start : start + self.prefill_chunk]])
            reference = self.reference.prefill_logprobs[self.chunk_index]
            kl += _kl(reference, logits[-reference.shape[0]:])
            self.chunk_index += 1
            if self.chunk_index * self.prefill_chunk >= len(self.prompt_ids):
                self.next_token = int(logits[-1].argmax())
            return kl
        for _ in range(self.decide_every):
            step = len(self.generated)
            self.generated.append(self.next_token)  # this cache's own pick at the position
            forced = self.reference.tokens[step]  # what is fed: the full cache's token (teacher forcing)
            if step + 1 >= self.new_tokens or self._is_eos(forced):
                self.done = True
                return kl
            logits = yield torch.tensor([[forced]])
            kl += _kl(self.reference.decode_logprobs[step : step + 1], logits[-1:])
            self.next_token = int(logits[-1].argmax())
            if any(self.cache.tables.count_in(layer, Tier.DEVICE) > self.budget[layer]
                   for layer in range(self.num_layers)):
                break
        return kl

    def _is_eos(self, token: int) -> bool:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos is not None and token == eos

    def _observe(self) -> dict[str, np.ndarray]:
        view = CacheView.from_cache(self.cache, self.budget)
        processed = self.cache.seen / self.total_tokens
        full_bytes = self.total_tokens * self.cache.bytes_per_token * self.num_layers
        self._encoded = encode(view, self.num_candidates, processed, self.budget_fraction,
                               self.bytes_moved_total / max(full_bytes, 1))
        return self._encoded.observation

    def _info(self, **values) -> dict:
        return {**values, "action_mask": self._encoded.mask.astype(np.int8), "budget_fraction": self.budget_fraction,
                "seen": self.cache.seen, "device_blocks": int(sum(self.cache.blocks_per_tier()["device"]))}

    def action_masks(self) -> np.ndarray:
        """Flat ``[K * 4]`` bool mask of legal ops (sb3-contrib's ``MaskablePPO`` calls this)."""
        return self._encoded.mask.reshape(-1).copy()

    def step(self, action):
        self._check_running("step")
        action = check_action(action, (self.num_candidates,))
        decisions, illegal = decode_action(action, self._encoded)
        return self.step_decisions(decisions, illegal)

    def cache_view(self) -> CacheView:
        """What a ``Controller`` sees at this decision point."""
        if self.cache is None:
            raise RuntimeError("cache_view() after close()" if self.closed else "call reset() before cache_view()")
        return CacheView.from_cache(self.cache, self.budget)

    def step_decisions(self, decisions: list, illegal: int = 0):
        """``step`` with ``Decision``s instead of an action: runs a controller (a baseline, or a loaded policy)
        through the same episode, rewards and info as the agent (``decisions = controller.decide(env.cache_view())``)."""
        self._check_running("step_decisions")
        pending = self.apply(decisions, illegal)
        return self.finish_step(self._advance(), pending)

    def _check_running(self, method: str) -> None:
        if self.closed:
            raise RuntimeError(f"{method}() after close(): the env's cache is released; call reset() to start "
                               "a new episode")
        if self.cache is None:
            raise RuntimeError(f"call reset() before {method}()")
        if self.done:
            raise RuntimeError("the episode has ended; call reset()")

    def apply(self, decisions: list, illegal: int = 0) -> dict:
        """The first half of a step: the decisions, then the budget fallback; returns what ``finish_step`` needs."""
        moved_before = sum(self.cache.bytes_moved.values())
        ops = apply_decisions(self.cache, decisions)
        fallbacks = self.cache.enforce_budget(self.budget, FALLBACK_RULE)
        within_budget = all(self.cache.tables.count_in(layer, Tier.DEVICE) <= self.budget[layer]
                            for layer in range(self.num_layers))
        moved = sum(self.cache.bytes_moved.values()) - moved_before
        self.bytes_moved_total += moved
        return dict(bytes_moved=moved, fallbacks=fallbacks, ops=ops, within_budget=within_budget, illegal_ops=illegal)

    def finish_step(self, kl: float, pending: dict):
        """The second half of a step, after the forwards to the next decision point: reward, observation, info."""
        task_score = self._task_score() if self.done else 0.0
        terms = reward_terms(kl, pending["bytes_moved"], task_score, lambda_bytes=self.lambda_bytes,
                             lambda_task=self.lambda_task)
        observation = self._observe()
        info = self._info(kl=kl, task_score=task_score, reward_terms=terms, **pending)
        if self.done:
            info["generated"] = list(self.generated)
        return observation, reward(terms), self.done, False, info

    def _task_score(self) -> float:
        """The score of this cache's teacher-forced answer (its picks, up to its first EOS)."""
        if self.sample.metric == "kl":
            return 0.0
        from eval.scoring import score

        answer = self.generated
        ends = [i for i, token in enumerate(answer) if self._is_eos(token)]
        text = self.tokenizer.decode(answer[: ends[0]] if ends else answer, skip_special_tokens=True)
        return float(score(self.sample, text))

    # ------------------------------------------------------------------ render
    def render(self):
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode='ansi' or 'rgb_array'")
            return None
        if self.cache is None:
            raise gym.error.ResetNeeded("render() before reset(): call env.reset() first, there is no cache to show")
        n = self.cache.num_logical_blocks()
        tiers = self.cache.tables.tier[:, :n]
        if self.render_mode == "ansi":
            symbols = {int(Tier.DEVICE): "D", int(Tier.HOST): "h", int(Tier.DISK): "d", int(Tier.DROPPED): "."}
            rows = [f"L{layer:02d} " + "".join(symbols.get(int(t), "?") for t in tiers[layer])
                    for layer in range(self.num_layers)]
            return "\n".join(rows) + f"\nseen {self.cache.seen} tokens, budget {self.budget[0]} blocks/layer\n"
        colours = np.array([[46, 204, 113], [52, 152, 219], [155, 89, 182], [40, 40, 40]], np.uint8)
        image = colours[tiers.clamp(min=0).numpy()]
        return np.repeat(np.repeat(image, 4, axis=0), 4, axis=1)

    def close(self):
        if self.cache is not None:
            self.cache.close()
        self.cache, self.closed = None, True
