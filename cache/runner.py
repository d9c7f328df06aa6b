"""The runner: chunked prefill, greedy or sampled decode, and the controller hook, over a ``PagedKVCache``.

Decision points: after every prefill chunk, every ``decide_every`` decode steps, and whenever a layer is
over its device budget. At each one the controller decides, its decisions are applied, then the cache
enforces every layer's budget with its fallback rule; the evictions that rule had to make are counted
as fallbacks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from cache.controller import CacheView, Controller, EvictOldest, apply_decisions
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.sentences import is_sentence_end, sentence_end_token_ids
from cache.tiers import Tier


def budget_blocks(budget: float | int | list[int] | None, total_tokens: int, block_size: int, num_layers: int,
                  pinned_blocks: int) -> list[int] | None:
    """Per-layer device budget in blocks.

    ``budget`` is ``None`` (no budget: full cache), a fraction in ``(0, 1]`` of the run's total tokens
    (prompt + new tokens), an absolute number of blocks per layer (int ``>= 1``), or a list with one
    block count per layer. A budget below the pinned blocks (sink + newest) is refused.
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


@dataclass
class RunResult:
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

    def summary(self) -> dict:
        tiers = {name: sum(counts) for name, counts in self.blocks_per_tier.items()}
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": len(self.new_tokens),
            "prefill_s": round(self.prefill_s, 3), "ttft_s": round(self.ttft_s, 3),
            "decode_ms_per_token": round(self.decode_ms_per_token, 2),
            "bytes_read_per_token": int(self.bytes_read_per_token), "bytes_moved": self.bytes_moved,
            "blocks_per_tier_all_layers": tiers, "operations": self.operations, "fallbacks": self.fallbacks,
            "decisions": self.decisions, "budget_blocks_per_layer": self.budget_blocks[0] if self.budget_blocks else None,
        }


class Runner:
    """Runs one sequence through a model with a ``PagedKVCache`` and a controller.

    ``controller`` defaults to ``EvictOldest`` when a budget is set; with no budget nothing is evicted.
    """

    def __init__(self, model, tokenizer=None, cache_config: CacheConfig | None = None,
                 controller: Controller | None = None, budget: float | int | list[int] | None = None,
                 prefill_chunk: int = 64, decide_every: int = 8, fallback_rule: str | None = None):
        if prefill_chunk < 1 or decide_every < 1:
            raise ValueError(f"prefill_chunk and decide_every must be >= 1, got {prefill_chunk}, {decide_every}")
        self.model = model
        self.tokenizer = tokenizer
        self.cache_config = cache_config or CacheConfig()
        self.controller = controller if controller is not None else (EvictOldest() if budget is not None else None)
        # a controller with ``full_cache = True`` (the FullCache baseline) runs without a budget
        self.budget = None if getattr(controller, "full_cache", False) else budget
        self.prefill_chunk = prefill_chunk
        self.decide_every = decide_every
        # the budget fallback: the controller's own preference (a trained policy names the rule it trained
        # with) unless one is given, else lowest accumulated mass
        self.fallback_rule = fallback_rule or getattr(controller, "fallback_rule", None) or "lowest_mass"
        self.sentence_end_ids = sentence_end_token_ids(tokenizer) if tokenizer is not None else None

    @property
    def max_positions(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor | list[int], max_new_tokens: int = 64, do_sample: bool = False,
            temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
            keep_logits: bool = False, forced_tokens: list[int] | None = None) -> RunResult:
        """Prefill ``input_ids`` in chunks, then decode up to ``max_new_tokens``.

        ``forced_tokens`` teacher-forces the continuation: those tokens are fed (and returned as
        ``new_tokens``) instead of the model's picks, so ``keep_logits`` gives the model's distribution at
        every position of a fixed text; ``max_new_tokens`` is then its length.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
        prompt_len = ids.shape[1]
        if forced_tokens is not None:
            if len(forced_tokens) == 0:
                raise ValueError("forced_tokens: give at least one token to teacher-force")
            max_new_tokens, stop_at_eos = len(forced_tokens), False
        total = prompt_len + max_new_tokens
        if prompt_len == 0:
            raise ValueError("input_ids: the prompt is empty")
        if total > self.max_positions:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = {total} exceeds the model's "
                f"{self.max_positions} positions; shorten the prompt or lower max_new_tokens"
            )
        config = self.cache_config
        if config.max_tokens is None or config.max_tokens < total:
            config = CacheConfig(**{**config.__dict__, "max_tokens": total})
        cache = PagedKVCache(self.model.config, config)
        budget = budget_blocks(self.budget, total, cache.block_size, cache.num_layers, config.sink_blocks + 1)
        device = next(self.model.parameters()).device
        ids = ids.to(device)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        state = {"fallbacks": 0, "decisions": 0, "ops": {}}

        start = time.perf_counter()
        for chunk_start in range(0, prompt_len, self.prefill_chunk):
            chunk = ids[:, chunk_start : chunk_start + self.prefill_chunk]
            self._observe(cache, chunk_start, chunk)
            out = self.model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1)
            self._decision_point(cache, budget, state)
        prefill_s = time.perf_counter() - start
        logits = out.logits[0, -1].float()
        token = forced_tokens[0] if forced_tokens else self._pick(logits, do_sample, temperature, top_p, generator)
        ttft_s = time.perf_counter() - start

        eos = self._eos_ids() if stop_at_eos else set()
        new_tokens, kept_logits, step_times, step_bytes = [token], [logits] if keep_logits else [], [], []
        for step in range(1, max_new_tokens):
            if token in eos:
                break
            step_start = time.perf_counter()
            fed = torch.tensor([[token]], device=device)
            self._observe(cache, prompt_len + step - 1, fed)
            out = self.model(input_ids=fed, cache=cache, use_cache=True)
            step_bytes.append(sum(cache.last_bytes_read))
            logits = out.logits[0, -1].float()
            token = (forced_tokens[step] if forced_tokens
                     else self._pick(logits, do_sample, temperature, top_p, generator))
            if step % self.decide_every == 0 or self._over_budget(cache, budget):
                self._decision_point(cache, budget, state)
            step_times.append(time.perf_counter() - step_start)
            new_tokens.append(token)
            if keep_logits:
                kept_logits.append(logits)

        text = self.tokenizer.decode(new_tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return RunResult(
            prompt_tokens=prompt_len, new_tokens=new_tokens, text=text, prefill_s=prefill_s, ttft_s=ttft_s,
            decode_ms_per_token=1000 * sum(step_times) / max(len(step_times), 1),
            bytes_read_per_token=sum(step_bytes) / max(len(step_bytes), 1),
            bytes_moved=cache.bytes_summary()["bytes_moved"], blocks_per_tier=cache.blocks_per_tier(),
            operations=state["ops"], fallbacks=state["fallbacks"], decisions=state["decisions"],
            budget_blocks=budget, logits=kept_logits, cache=cache,
        )

    def _observe(self, cache: PagedKVCache, start: int, token_ids: torch.Tensor) -> None:
        if self.sentence_end_ids is not None:
            cache.observe_tokens(start, is_sentence_end(token_ids[0].cpu(), self.sentence_end_ids))

    def _over_budget(self, cache: PagedKVCache, budget: list[int] | None) -> bool:
        if budget is None:
            return False
        return any(cache.tables.count_in(layer, Tier.DEVICE) > budget[layer] for layer in range(cache.num_layers))

    def _decision_point(self, cache: PagedKVCache, budget: list[int] | None, state: dict) -> None:
        if self.controller is None or budget is None:
            return
        state["decisions"] += 1
        view = CacheView.from_cache(cache, budget)
        for name, count in apply_decisions(cache, self.controller.decide(view)).items():
            state["ops"][name] = state["ops"].get(name, 0) + count
        state["fallbacks"] += cache.enforce_budget(budget, self.fallback_rule)

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
