"""The runner: the evaluation protocols over a ``PagedKVCache`` — prefill, greedy or sampled decode, and the
controller hook.

A prompt (``Prompt``) knows its parts: the context (``ids[:context_end]``), then the question and the answer
prefix (``ids[context_end:]``), and, for multi-turn samples, later turns fed after each answer. The budget is
a fraction of the **context** (the field's convention: kvpress, SnapKV, RULER leaderboards), a block count
per layer, or a per-layer list. The last prompt token is always fed after the last prompt decision, so the
first answer token is computed on the cache the controller decided. Protocols (``PROTOCOLS``):

- ``streaming`` (bounded peak memory): the context and then the question are prefilled in chunks of
  ``prefill_chunk`` tokens (a chunk never straddles the two); the controller decides after every chunk
  (phase ``prefill``), and once more after the question has been read (phase ``question``: the last chunk's
  statistics are the question's queries; retrieval and prefetch belong here); then the last prompt token
  gives the first answer token; decisions continue every ``decide_every`` decode steps and whenever a
  layer is over budget. The budget holds throughout.
- ``oneshot`` (kvpress's pipeline): dense prefill of the context (no decisions, no budget; chunks aligned to
  its end so the last one holds the last ``stats_window`` queries: SnapKV's window), **one** decision
  (phase ``compress``) with the budget, then the question and answer prefix through the compressed cache,
  then decoding with the cache growing (``decode_budget="fixed"`` keeps the budget and decides as in
  streaming). A prompt without a question part is compressed up to its last token.
- ``oneshot-question``: the same with the whole prompt but its last token in the dense prefill (query-aware
  methods see the question).
- ``multiturn``: streaming over the context and the first question, then each answer is decoded (greedy,
  until EOS or ``max_new_tokens``) before the next turn's tokens arrive (the previous answer's last token
  first); a ``question`` decision point after each turn's question; the budget holds across turns.
- A multi-turn prompt under ``oneshot`` / ``oneshot-question``: compressed **once** (as above), then the turns
  follow as in ``multiturn`` on the compressed cache — which grows, so no decision comes after the compression
  (``decode_budget="fixed"``: the budget holds and the later turns' decision points run as in ``multiturn``).
  This is the "compress once, ask many questions" use of query-agnostic compression (kvpress's pipeline takes
  a list of questions for one compressed context; here they come as one conversation).

At each decision point the controller decides, its decisions are applied, then the cache enforces every
layer's budget with its fallback rule; the evictions that rule had to make are counted as fallbacks.

Budget scope (``budget_scope``; None: the controller's ``budget_scope`` attribute, else ``layer``): ``layer``
gives every layer its own budget; ``global`` (kvpress's ``layerwise=False``) holds only the total over layers:
the controller sees it as ``CacheView.total_budget`` and decides how many blocks each layer keeps. After each decision that leaves the total within it, each
layer's device blocks become its allocation (``CacheView.budget_blocks`` at the next decision, what the
fallback enforces when a later decision leaves the total over).
One-shot runs can share their dense prefill across controllers and budgets (``Runner.dense_prefill``,
then ``run(..., shared=...)`` on a copy of its cache).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from cache.controller import CacheView, Controller, EvictOldest, apply_decisions, layer_budgets
from cache.copies import COPY_WINDOW, reread_tokens
from cache.driving import EXTERNAL, Decide, Forward, drive
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.sentences import is_sentence_end, sentence_end_token_ids
from cache.tiers import Tier


def budget_blocks(budget: float | int | list[int] | None, total_tokens: int, block_size: int, num_layers: int,
                  pinned_blocks: int) -> list[int] | None:
    """Per-layer device budget in blocks.

    ``budget`` is ``None`` (no budget: full cache), a fraction in ``(0, 1]`` of ``total_tokens`` (the
    runner passes the context's tokens), an absolute number of blocks per layer (int ``>= 1``), or a list
    with one block count per layer. A budget below the pinned blocks (sink + newest) is refused.
    """
    if budget is None:
        return None
    if isinstance(budget, (list, tuple)):
        if len(budget) != num_layers:
            raise ValueError(f"budget: a per-layer list needs {num_layers} entries, got {len(budget)}")
        blocks = [int(b) for b in budget]
    elif isinstance(budget, float) or (isinstance(budget, int) and budget == 0):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget: a fraction must be in (0, 1], got {budget}")
        blocks = [math.ceil(budget * total_tokens / block_size)] * num_layers
    elif isinstance(budget, int):
        blocks = [budget] * num_layers
    else:
        raise ValueError(f"budget: expected a fraction, a block count or a per-layer list, got {budget!r}")
    low = min(blocks)
    if low < pinned_blocks:
        raise ValueError(
            f"budget: {low} device blocks per layer is below the {pinned_blocks} pinned blocks "
            f"(sink blocks + the newest block); use at least {pinned_blocks} blocks "
            f"(a fraction of at least {pinned_blocks * block_size / max(total_tokens, 1):.3f} for {total_tokens} tokens)"
        )
    return blocks


def parse_budget(text, flag: str = "--budget"):
    """The one budget parser: ``0.25`` → a fraction of the context; ``64`` → blocks per layer; ``none`` /
    ``full`` / None → no budget. Errors name ``flag``."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("none", "full")):
        return None
    if isinstance(text, bool):
        raise ValueError(f"{flag} {text!r}: use a fraction like 0.25, a block count like 64, or 'full'")
    if isinstance(text, (int, float)):
        value = text
    else:
        try:
            value = int(text) if str(text).strip().isdigit() else float(text)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: use a fraction like 0.25, a block count like 64, or 'full'") from None
    if isinstance(value, float) and (math.isnan(value) or not 0.0 < value <= 1.0):
        raise ValueError(f"{flag} {text!r}: a fraction must be in (0, 1] (a share of the context's tokens)")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"{flag} {text!r}: a block count must be >= 1")
    return value


PROTOCOLS = ("streaming", "oneshot", "oneshot-question", "multiturn")
DECODE_BUDGETS = ("grow", "fixed")
BUDGET_SCOPES = ("layer", "global")


@dataclass
class Prompt:
    """Token ids of a sample's prompt and where its parts end.

    ``ids`` is the first turn's prompt (context, question, answer prefix); ``ids[:context_end]`` is the
    context (``context_end=None``: the whole prompt); ``turns`` are the later turns' ids (question + answer
    prefix each), fed after the previous answer (multi-turn samples only).
    """

    ids: list[int]
    context_end: int | None = None
    turns: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self.ids = [int(t) for t in (self.ids.flatten().tolist() if isinstance(self.ids, torch.Tensor) else self.ids)]
        if not self.ids:
            raise ValueError("prompt: the prompt is empty")
        if self.context_end is None:
            self.context_end = len(self.ids)
        if not 1 <= self.context_end <= len(self.ids):
            raise ValueError(f"prompt: context_end {self.context_end} is outside 1..{len(self.ids)}")
        for number, turn in enumerate(self.turns, start=2):
            if not turn:
                raise ValueError(f"prompt: turn {number} has no tokens")

    @property
    def context_tokens(self) -> int:
        return self.context_end


@dataclass
class SharedPrefill:
    """The dense prefill of a one-shot protocol, computed once and copied into every run that shares it."""

    cache: PagedKVCache
    prompt: Prompt
    protocol: str
    dense_end: int
    max_new_tokens: int
    seconds: float


@dataclass
class RunResult:
    """What one run produced: tokens, text, timings, bytes, operations and the cache's final state."""
    prompt_tokens: int
    new_tokens: list[int]
    text: str | None
    prefill_s: float
    ttft_s: float
    decode_ms_per_token: float
    bytes_read_per_token: float  # all layers, mean over decode steps
    bytes_moved: dict[str, int]
    blocks_per_tier: dict[str, list[int]]
    operations: dict[str, int]
    fallbacks: int
    decisions: int
    budget_blocks: list[int] | None
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    cache: PagedKVCache | None = field(default=None, repr=False)
    protocol: str = "streaming"
    context_tokens: int = 0
    # multi-turn runs: every turn's generated tokens and text, and the logits of each turn's first answer token
    turn_tokens: list[list[int]] = field(default_factory=list)
    turn_texts: list[str | None] = field(default_factory=list)
    turn_logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    peak_device_blocks: int = 0  # most device blocks held at once, summed over layers

    def summary(self) -> dict:
        tiers = {name: sum(counts) for name, counts in self.blocks_per_tier.items()}
        return {
            "protocol": self.protocol, "prompt_tokens": self.prompt_tokens, "context_tokens": self.context_tokens,
            "new_tokens": len(self.new_tokens),
            "prefill_s": round(self.prefill_s, 3), "ttft_s": round(self.ttft_s, 3),
            "decode_ms_per_token": round(self.decode_ms_per_token, 2),
            "bytes_read_per_token": int(self.bytes_read_per_token), "bytes_moved": self.bytes_moved,
            "blocks_per_tier_all_layers": tiers, "operations": self.operations, "fallbacks": self.fallbacks,
            "decisions": self.decisions, "budget_blocks_per_layer": self.budget_blocks[0] if self.budget_blocks else None,
        }


@dataclass
class _State:
    """One run's moving parts."""

    cache: PagedKVCache
    budget: list[int] | None  # enforced at decision points (None: no decisions); global scope: the allocation
    token_ids: list[int]
    context_end: int  # the prompt's context length: a decision past it has read the question
    question_start: int = 0  # where the current turn's question begins (the question's re-read starts there)
    total: int | None = None  # global budget scope: the device budget of all layers together
    fallbacks: int = 0
    decisions: int = 0
    ops: dict = field(default_factory=dict)
    peak: int = 0


class Runner:
    """Runs one sequence through a model with a ``PagedKVCache`` and a controller, in one of ``PROTOCOLS``.

    ``controller`` defaults to ``EvictOldest`` when a budget is set; with no budget nothing is evicted.
    """

    def __init__(self, model, tokenizer=None, cache_config: CacheConfig | None = None,
                 controller: Controller | None = None, budget: float | int | list[int] | None = None,
                 prefill_chunk: int = 64, decide_every: int = 8, fallback_rule: str | None = None,
                 protocol: str = "streaming", decode_budget: str = "grow", budget_scope: str | None = None):
        if prefill_chunk < 1 or decide_every < 1:
            raise ValueError(f"prefill_chunk and decide_every must be >= 1, got {prefill_chunk}, {decide_every}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"--protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        if decode_budget not in DECODE_BUDGETS:
            raise ValueError(f"--decode-budget {decode_budget!r}: choose one of {', '.join(DECODE_BUDGETS)}")
        # the budget scope: as given, else the controller's own (KVzip's default is global, as in kvpress), else layer
        budget_scope = budget_scope or getattr(controller, "budget_scope", None) or "layer"
        if budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"--budget-scope {budget_scope!r}: choose one of {', '.join(BUDGET_SCOPES)}")
        self.model = model
        self.tokenizer = tokenizer
        self.cache_config = cache_config or CacheConfig()
        self.controller = controller if controller is not None else (EvictOldest() if budget is not None else None)
        # a controller with ``full_cache = True`` (the FullCache baseline) runs without a budget
        self.budget = None if getattr(controller, "full_cache", False) else budget
        self.prefill_chunk = prefill_chunk
        self.decide_every = decide_every
        self.protocol = protocol
        self.decode_budget = decode_budget
        self.budget_scope = budget_scope
        # the budget fallback: the controller's own preference (a trained policy names the rule it trained
        # with) unless one is given, else lowest accumulated mass
        self.fallback_rule = fallback_rule or getattr(controller, "fallback_rule", None) or "lowest_mass"
        # a controller with ``question_reread = True``: its question (its last COPY_WINDOW tokens, if longer) is
        # re-encoded over every live block before the question's decision (``cache.copies.reread_tokens``)
        self.question_reread = bool(getattr(controller, "question_reread", False))
        self.reread_attention = bool(getattr(controller, "reread_attention", False))  # its attention as the stats too
        self.sentence_end_ids = sentence_end_token_ids(tokenizer) if tokenizer is not None else None

    @property
    def max_positions(self) -> int:
        return int(self.model.config.max_position_embeddings)

    # ------------------------------------------------------------------ pieces
    def _total_tokens(self, prompt: Prompt, max_new_tokens: int) -> int:
        return len(prompt.ids) + sum(len(turn) + 1 for turn in prompt.turns) + max_new_tokens * (1 + len(prompt.turns))

    def _new_cache(self, total: int, **changes) -> PagedKVCache:
        config = self.cache_config
        if config.max_tokens is None or config.max_tokens < total:
            changes["max_tokens"] = total
        if changes:
            config = CacheConfig(**{**config.__dict__, **changes})
        return PagedKVCache(self.model.config, config)

    def _check_length(self, prompt: Prompt, max_new_tokens: int) -> int:
        total = self._total_tokens(prompt, max_new_tokens)
        if total > self.max_positions:
            raise ValueError(
                f"prompt of {len(prompt.ids)} tokens + max_new_tokens {max_new_tokens} = {total} exceeds the model's "
                f"{self.max_positions} positions; shorten the prompt or lower max_new_tokens"
            )
        return total

    def _dense_end(self, prompt: Prompt, protocol: str) -> int:
        if protocol == "oneshot":
            return min(prompt.context_end, len(prompt.ids) - 1)
        if protocol == "oneshot-question":
            return len(prompt.ids) - 1
        return 0

    def _feed(self, cache: PagedKVCache, state: _State | None, ids: list[int]):
        """One forward of ``ids`` (observed for sentence ends); returns the last position's logits."""
        return drive(self._forward(cache, state, ids))

    def _forward(self, cache: PagedKVCache, state: _State | None, ids: list[int]):
        """``_feed`` as a step of a run's generator: it yields a ``Forward`` and the driver sends back the last
        position's logits (one forward alone, or one row of a batched forward: ``run_batched``)."""
        self._observe(cache, cache.seen, torch.tensor([ids]))
        logits = yield Forward(self.model, cache, ids)
        if state is not None:
            state.token_ids.extend(ids)
            state.peak = max(state.peak, sum(cache.tables.count_in(layer, Tier.DEVICE) for layer in range(cache.num_layers)))
        return logits

    def _chunks(self, start: int, end: int, from_end: bool = False) -> list[tuple[int, int]]:
        """``[start, end)`` in ``prefill_chunk`` pieces, aligned to ``start`` (or to ``end``)."""
        size, length = self.prefill_chunk, end - start
        if length <= 0:
            return []
        cuts = list(range(start, end, size)) if not from_end else sorted({start, *range(end - size, start, -size)})
        return [(a, min(b, end)) for a, b in zip(cuts, cuts[1:] + [end], strict=True)]

    @torch.no_grad()
    def dense_prefill(self, prompt, max_new_tokens: int = 64, protocol: str | None = None) -> SharedPrefill:
        """The dense part of a one-shot protocol (no decisions, no budget), to share across runs."""
        prompt = prompt if isinstance(prompt, Prompt) else Prompt(prompt)
        protocol = protocol or self.protocol
        if protocol not in ("oneshot", "oneshot-question"):
            raise ValueError(f"dense_prefill: protocol {protocol!r} has no dense prefill (only oneshot, oneshot-question)")
        total = self._check_length(prompt, max_new_tokens)
        start = time.perf_counter()
        cache = self._new_cache(total, host_blocks=0, disk_blocks=0)
        dense_end = self._dense_end(prompt, protocol)
        for a, b in self._chunks(0, dense_end, from_end=True):
            self._feed(cache, None, prompt.ids[a:b])
        return SharedPrefill(cache, prompt, protocol, dense_end, max_new_tokens, time.perf_counter() - start)

    # ------------------------------------------------------------------ the run
    def run(self, input_ids, max_new_tokens: int = 64, **options) -> RunResult:
        """``steps`` driven one forward at a time (``run_batched`` drives several runs through batched forwards)."""
        return drive(self.steps(input_ids, max_new_tokens, **options))

    def steps(self, input_ids, max_new_tokens: int = 64, do_sample: bool = False,
              temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
              keep_logits: bool = False, forced_tokens: list[int] | None = None,
              shared: SharedPrefill | None = None, on_token=None):
        """A generator that runs ``input_ids`` (a ``Prompt``, or token ids: the whole prompt is then the context)
        under the runner's protocol, then decodes up to ``max_new_tokens`` per turn; it yields each forward it
        needs as a ``Forward`` and takes the last position's logits back; with the controller ``EXTERNAL`` it also
        yields a ``Decide`` at each decision point and takes the decision back (a gymnasium env: the agent
        decides). It returns the ``RunResult``.

        ``forced_tokens`` teacher-forces the continuation: those tokens are fed (and returned as
        ``new_tokens``) instead of the model's picks, so ``keep_logits`` gives the model's distribution at
        every position of a fixed text; ``max_new_tokens`` is then its length. ``shared`` continues from a
        copy of a ``dense_prefill`` of the same prompt (one-shot protocols). ``on_token(turn, step, logits,
        token)`` is called as each answer token is picked (``logits``: the distribution it was picked from).
        """
        prompt = input_ids if isinstance(input_ids, Prompt) else Prompt(input_ids)
        protocol = self.protocol
        if forced_tokens is not None:
            if len(forced_tokens) == 0:
                raise ValueError("forced_tokens: give at least one token to teacher-force")
            if prompt.turns:
                raise ValueError("forced_tokens: teacher forcing takes a single-turn prompt")
            max_new_tokens, stop_at_eos = len(forced_tokens), False
        if prompt.turns and protocol == "streaming":
            raise ValueError(f"--protocol {protocol}: the sample has {len(prompt.turns) + 1} turns; use --protocol "
                             "multiturn (streamed, the budget held across turns) or oneshot (compressed once)")
        total = self._check_length(prompt, max_new_tokens)
        budget = budget_blocks(self.budget, prompt.context_tokens, self.cache_config.block_size,
                               self.model.config.num_hidden_layers, self.cache_config.sink_blocks + 1)
        if budget is not None and self.controller is not None:
            budget = layer_budgets(self.controller, budget)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        one_shot = protocol in ("oneshot", "oneshot-question")
        dense_end = self._dense_end(prompt, protocol)

        track_query_max = bool(getattr(self.controller, "track_query_max", False))
        start = time.perf_counter()
        if shared is not None:
            if shared.prompt.ids != prompt.ids or shared.protocol != protocol or shared.max_new_tokens < max_new_tokens:
                raise ValueError("shared: the dense prefill was made for another prompt, protocol or length")
            changes = {name: getattr(self.cache_config, name) for name in ("host_blocks", "disk_blocks", "disk_dir")}
            cache = shared.cache.clone(**changes, track_query_max=track_query_max)
            start -= shared.seconds  # the shared prefill counts in this run's time to first token
        else:
            cache = self._new_cache(total, **({"track_query_max": True} if track_query_max else {}))
            for a, b in self._chunks(0, dense_end, from_end=True):
                yield from self._forward(cache, None, prompt.ids[a:b])
        state = _State(cache, budget, list(prompt.ids[:dense_end]), prompt.context_end, prompt.context_end,
                       total=sum(budget) if budget is not None and self.budget_scope == "global" else None)
        if one_shot:
            yield from self._decision_point(state, "compress")
            if self.decode_budget == "grow":
                state.budget = state.total = None  # kvpress: the cache grows after the one compression
        # the rest of the prompt but its last token: streamed (context, then question), decisions after chunks
        last = len(prompt.ids) - 1
        segments = [(dense_end, min(prompt.context_end, last)), (max(prompt.context_end, dense_end), last)]
        for a, b in [piece for seg in segments for piece in self._chunks(*seg)]:
            yield from self._forward(cache, state, prompt.ids[a:b])
            if not one_shot or self._over_budget(cache, state):
                # the chunk that ends the question is the question's decision point
                yield from self._decision_point(state, "question" if b == last and not one_shot else "prefill")
        prefill_s = time.perf_counter() - start

        eos = self._eos_ids() if stop_at_eos else set()
        turns = [prompt.ids[last:]] + [list(turn) for turn in prompt.turns]
        turn_tokens, turn_logits, kept_logits, step_times, step_bytes = [], [], [], [], []
        ttft_s = 0.0
        for number, turn in enumerate(turns):
            if number > 0:  # the previous answer's last token and this turn's question, streamed
                fed = [turn_tokens[-1][-1]] + turn[:-1]
                state.question_start = len(state.token_ids) + 1
                for a, b in self._chunks(0, len(fed)):
                    yield from self._forward(cache, state, fed[a:b])
                    yield from self._decision_point(state, "question" if b == len(fed) else "prefill")
            logits = yield from self._forward(cache, state, turn[-1:])
            token = forced_tokens[0] if forced_tokens else self._pick(logits, do_sample, temperature, top_p, generator)
            if number == 0:
                ttft_s = time.perf_counter() - start
            if on_token is not None:
                on_token(number, 0, logits, token)
            # the last prompt token's forward is decode step 0 (a decision every decide_every steps counts from it)
            yield from self._decision_point(state, "decode")
            new_tokens = [token]
            turn_logits.append(logits)
            if keep_logits and number == 0:
                kept_logits.append(logits)
            for step in range(1, max_new_tokens):
                if token in eos:
                    break
                step_start = time.perf_counter()
                logits = yield from self._forward(cache, state, [token])
                step_bytes.append(sum(cache.last_bytes_read))
                token = (forced_tokens[step] if forced_tokens
                         else self._pick(logits, do_sample, temperature, top_p, generator))
                if on_token is not None:
                    on_token(number, step, logits, token)
                if step % self.decide_every == 0 or self._over_budget(cache, state):
                    yield from self._decision_point(state, "decode")
                step_times.append(time.perf_counter() - step_start)
                new_tokens.append(token)
                if keep_logits and number == 0:
                    kept_logits.append(logits)
            turn_tokens.append(new_tokens)

        decode = (lambda tokens: self.tokenizer.decode(tokens, skip_special_tokens=True)) if self.tokenizer is not None \
            else (lambda tokens: None)
        return RunResult(
            prompt_tokens=len(prompt.ids), new_tokens=turn_tokens[0], text=decode(turn_tokens[0]), prefill_s=prefill_s,
            ttft_s=ttft_s, decode_ms_per_token=1000 * sum(step_times) / max(len(step_times), 1),
            bytes_read_per_token=sum(step_bytes) / max(len(step_bytes), 1),
            bytes_moved=cache.bytes_summary()["bytes_moved"], blocks_per_tier=cache.blocks_per_tier(),
            operations=state.ops, fallbacks=state.fallbacks, decisions=state.decisions,
            budget_blocks=budget, logits=kept_logits, cache=cache, protocol=protocol,
            context_tokens=prompt.context_tokens, turn_tokens=turn_tokens,
            turn_texts=[decode(tokens) for tokens in turn_tokens], turn_logits=turn_logits, peak_device_blocks=state.peak,
        )

    def _observe(self, cache: PagedKVCache, start: int, token_ids: torch.Tensor) -> None:
        if self.sentence_end_ids is not None:
            cache.observe_tokens(start, is_sentence_end(token_ids[0].cpu(), self.sentence_end_ids))

    @staticmethod
    def _device_blocks(cache: PagedKVCache) -> list[float]:
        """Each layer's ``device_load``: its device blocks, a block some KV heads dropped counted by its share."""
        return [cache.device_load(layer) for layer in range(cache.num_layers)]

    def _over_budget(self, cache: PagedKVCache, state: _State) -> bool:
        if state.budget is None:
            return False
        device = self._device_blocks(cache)
        if state.total is not None:
            return sum(device) > state.total + 1e-9
        return any(count > limit + 1e-9 for count, limit in zip(device, state.budget, strict=True))

    def _decision_point(self, state: _State, phase: str):
        if self.controller is None or state.budget is None:
            return
        cache = state.cache
        state.decisions += 1

        def view_now():
            return CacheView.from_cache(cache, state.budget, phase=phase, model=self.model,
                                        token_ids=torch.tensor(state.token_ids, dtype=torch.long),
                                        question_read=len(state.token_ids) > state.context_end,
                                        total_budget=state.total)

        view = view_now()
        if phase == "question" and self.question_reread and state.question_start < view.seen:
            reread_tokens(view, max(state.question_start, view.seen - COPY_WINDOW), attention=self.reread_attention)
            state.ops["reread"] = state.ops.get("reread", 0) + 1
            view = view_now()
        decision = (yield Decide(view)) if self.controller is EXTERNAL else self.controller.decide(view)
        for name, count in apply_decisions(cache, decision).items():
            state.ops[name] = state.ops.get(name, 0) + count
        if state.total is not None:
            device = self._device_blocks(cache)
            if sum(device) <= state.total + 1e-9:
                state.budget = [math.ceil(load - 1e-9) for load in device]  # the controller's allocation
        state.fallbacks += cache.enforce_budget(state.budget, self.fallback_rule)

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    @staticmethod
    def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float,
              generator: torch.Generator | None) -> int:
        if not do_sample:
            return int(logits.argmax())
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        probs = torch.softmax(logits.cpu() / temperature, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cut = torch.cumsum(sorted_probs, 0) - sorted_probs >= top_p
            sorted_probs[cut] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))
