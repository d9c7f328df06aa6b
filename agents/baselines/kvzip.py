"""KVzip (Kim et al., 2025, arXiv 2505.23416, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction"; official code github.com/snu-mllab/KVzip; kvpress ``KVzipPress``, followed here): keep what the
model needs to **reconstruct** its context.

The rule (kvpress 0.5.5): after the prefill, the model is fed "\\n\\nRepeat the previous context exactly." + the
turn suffix + the context again (in chunks of ``chunk_size`` context tokens; a later chunk's instruction asks to
"Repeat the part of the previous context exactly, starting with" the previous chunk's last 8 tokens), on top
of the prefilled cache. A context token's score is the **largest** attention any reconstruction query pays it
(max over the reconstruction queries and over the query heads of its KV group); the first ``n_sink`` tokens are
always kept; the appended reconstruction is then discarded. kvpress prunes the lowest scores over all layers and
heads at once (``layerwise = False``), or the same share of every layer (``layerwise = True``).

On blocks:

- reconstruction: a fresh ``PagedKVCache`` is filled with a copy of each layer's device tokens, and
  ``view.model`` runs the repeat input on it at the positions following ``view.seen`` (in forwards of 128 tokens,
  to bound memory), with the cache recording every reconstruction query's attention (``track_query_max``): a block's
  score per query head is the largest attention mass (summed over the block's tokens) any single
  reconstruction query pays it (``BlockStats.query_max_heads``); at block size 1 this is kvpress's token score.
  The softmax runs over all the copied tokens and the reconstruction (kvpress: over the sinks, the chunk
  being rebuilt and the reconstruction: the same for contexts of at most ``chunk_size`` tokens);
- heads: ``aggregation = "max"`` over the layer's query heads (kvpress: max over each KV group);
- selection: the blocks holding the first ``n_sink`` tokens are protected; the lowest-scoring device blocks are
  evicted. As in kvpress, by default over all layers at once (``layerwise=False``: the controller asks the runner
  for a global budget, ``budget_scope = "global"``, so each layer keeps as many blocks as its scores earn), or
  until each layer fits the same share (``layerwise=true``); a run's ``--budget-scope`` overrides either;
- input: the repeat text is tokenised with the model's tokenizer (``AutoTokenizer`` on the model's
  ``name_or_path``), with the suffix kvpress uses without a chat template, a newline. Every token seen is
  repeated (kvpress skips the chat template's prefix when there is one, and then opens an assistant turn
  instead of the newline). A model without a loadable tokenizer (the tiny test model) repeats the context
  with no instruction.

Decision points (``view.phase``): the reconstruction needs the whole context, so it runs at ``compress`` (one-
shot: kvpress's KVzip) and at ``question`` (streaming: over each layer's blocks still on the device, with every
token seen repeated), when a layer is over budget. At the other decisions (streaming ``prefill`` chunks,
``decode``) no reconstruction runs (one per 64-token chunk would cost a forward over the resident context per
chunk): the blocks scored by the last reconstruction are evicted lowest first, the blocks written since go
after all of them, oldest first; before any reconstruction (streaming prefill) that is a sliding window behind
the pinned sink.

Cost: one forward of (instruction + every token seen) over a copy of the cache, with the attention of every
reconstruction query recorded (about as much again as the forward's own attention); see the report of issue 12
for the measured time on SmolLM2-135M at 2k tokens.

Per KV head (``per_head``, default true, as kvpress): at the reconstruction's decision each KV head keeps its own
blocks: a (layer, KV head, block) is scored by the largest mass over the head's query group, and the lowest lose
that head's view of the block (``PagedKVCache.drop_head``: masked, as kvpress masks keys; a block goes, and its
memory with it, when its last head does) until the budget, counted in head shares, holds. Later decisions evict
whole blocks. ``per_head=false``: one block set per layer (the max over all the layer's query heads). Measured on
held-out families (``results/kvpress_peer/``): per-head selection and global pruning each matter, most at 8×.

Deviations: blocks of 16 tokens (``--block-size 1`` gives kvpress's tokens); a partly kept block costs its whole
memory and bandwidth until its last head drops it (kvpress's masking saves neither either); KVzip+ normalisation not
offered (kvpress's ``kvzip_plus_normalization``, off by default).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from agents.baselines.base import AGGREGATIONS, check_choice, evict_lowest, over_heads, prompt_first_priority
from cache.controller import CacheView, Decision, Op
from cache.copies import COPY_WINDOW, resident_copy
from cache.tiers import Tier

FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
NEXT_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP_TOKENS = 8  # a later chunk's instruction quotes the previous chunk's last 8 tokens
SUFFIX = "\n"  # the turn suffix without a chat template
PIECE_TOKENS = COPY_WINDOW  # the reconstruction is fed in pieces: each forward's per-query attention stays small


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def text_ids(model, text: str) -> list[int]:
    """``text`` in the model's tokens (no special tokens); empty when the model has no loadable tokenizer."""
    tokenizer = _tokenizer(str(getattr(model.config, "name_or_path", "") or ""))
    return [] if tokenizer is None else list(tokenizer.encode(text, add_special_tokens=False))


def repeat_inputs(model, token_ids: list[int], chunk_size: int) -> list[tuple[int, int, list[int]]]:
    """``(first, end, ids)`` of each reconstruction pass: the context positions ``[first, end)`` it rebuilds and
    its input (instruction, suffix, then those tokens)."""
    passes = []
    for first in range(0, len(token_ids), chunk_size):
        end = min(first + chunk_size, len(token_ids))
        if first == 0:
            instruction = text_ids(model, FIRST_INSTRUCTION)
        else:
            instruction = text_ids(model, NEXT_INSTRUCTION) + token_ids[max(first - OVERLAP_TOKENS, 0) : first]
        passes.append((first, end, instruction + text_ids(model, SUFFIX) + token_ids[first:end]))
    return passes


@torch.no_grad()
def reconstruction_mass(view: CacheView, chunk_size: int) -> torch.Tensor:
    """``[L, H, N]``: per query head, the largest attention mass any reconstruction query pays each device
    block (0 for the others). The newest block, when partly filled, shares its block of the copy with the first
    reconstruction tokens, so its score also counts their attention; it is pinned, so that never matters."""
    model = view.model
    token_ids = view.token_ids.flatten().tolist()
    device = next(model.parameters()).device
    result = None
    for first, end, ids in repeat_inputs(model, token_ids, chunk_size):
        copy, resident = resident_copy(view, len(ids))
        for start in range(0, len(ids), PIECE_TOKENS):  # causal: pieces in order give the same attention
            piece = ids[start : start + PIECE_TOKENS]
            positions = torch.arange(view.seen + start, view.seen + start + len(piece), device=device)[None]
            model(input_ids=torch.tensor([piece], device=device), cache=copy, use_cache=True, position_ids=positions,
                  logits_to_keep=1)
        peak = copy.stats.query_max_heads  # [L, H, copy blocks]: the max over every piece's queries
        if result is None:
            result = torch.zeros(view.num_layers, peak.shape[1], view.num_blocks)
        for layer, blocks in enumerate(resident):
            start = view.first_position[blocks]
            in_pass = (start >= first) & (start < end)
            result[layer][:, blocks[in_pass]] = peak[layer, :, : len(blocks)][:, in_pass]
    return result


_RECENT: OrderedDict = OrderedDict()  # one-shot reconstructions of the latest prompts (see ``_one_shot_mass``)


def _one_shot_mass(view: CacheView, chunk_size: int) -> torch.Tensor:
    """``reconstruction_mass``, computed once per prompt for the one-shot compressions: at ``compress`` the cache
    holds exactly the dense prefill of ``view.token_ids`` (every block on the device), so the reconstruction of the
    same model, prompt, block size and chunk size is the same for every budget and every run of an evaluation grid
    (it is KVzip's whole cost). Other phases run it afresh."""
    if view.phase != "compress" or bool((view.tier != Tier.DEVICE).any()):
        return reconstruction_mass(view, chunk_size)
    key = (id(view.model), view.cache.block_size, chunk_size, tuple(view.token_ids.flatten().tolist()))
    model, mass = _RECENT.get(key, (None, None))
    if model is None or model() is not view.model:  # a model freed since and another at its address: recompute
        mass = reconstruction_mass(view, chunk_size)
        _RECENT[key] = (weakref.ref(view.model), mass)
        while len(_RECENT) > 2:
            _RECENT.popitem(last=False)
    return mass


def forget_reconstructions() -> None:
    """Drop the remembered one-shot reconstructions (``_one_shot_mass``)."""
    _RECENT.clear()


@dataclass
class KVzip:
    """KVzip: keep the blocks a reconstruction of the context needs (module docstring)."""
    n_sink: int = 4  # kvpress default: the first tokens are always kept
    chunk_size: int = 2048  # context tokens rebuilt per reconstruction pass (kvpress default)
    aggregation: str = "max"  # over query heads: "max" (kvpress: max over each KV group) or "mean"
    layerwise: bool = False  # kvpress's flag: the same share of every layer instead of the lowest over all layers
    per_head: bool = True  # kvpress: each KV head keeps its own blocks (by masking); false: one block set per layer
    _scores: torch.Tensor | None = field(default=None, init=False, repr=False)  # [L, P] of the last reconstruction
    _cache: weakref.ref | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        check_choice("KVzip", "aggregation", self.aggregation, AGGREGATIONS)
        if self.chunk_size < 1 or self.n_sink < 0:
            raise ValueError(f"KVzip: chunk_size must be >= 1 and n_sink >= 0, got {self.chunk_size}, {self.n_sink}")

    @property
    def budget_scope(self) -> str:
        """The runner's budget scope this controller asks for (``cache.runner``): kvpress's ``layerwise``."""
        return "layer" if self.layerwise else "global"

    def reconstruction_scores(self, view: CacheView) -> torch.Tensor:
        """``[L, N]`` block scores from a reconstruction pass (see the module docstring)."""
        return over_heads(_one_shot_mass(view, self.chunk_size), self.aggregation)

    def decide(self, view: CacheView) -> list[Decision]:
        if self._cache is None or self._cache() is not view.cache:
            self._cache, self._scores = weakref.ref(view.cache), None
        over_budget = bool((view.device_blocks() > view.budget_blocks).any())
        if (view.phase in ("compress", "question") and over_budget and view.model is not None
                and view.token_ids is not None):
            mass = _one_shot_mass(view, self.chunk_size)
            self._scores = over_heads(mass, self.aggregation)
            if self.per_head:
                return self._drop_heads(view, mass)
        scores = self._scores if self._scores is not None else torch.zeros(view.num_layers, 0)
        return evict_lowest(view, prompt_first_priority(scores, view.num_blocks),
                            protect=view.first_position < self.n_sink)

    def _drop_heads(self, view: CacheView, mass: torch.Tensor) -> list[Decision]:
        """kvpress's per-KV-head selection: the lowest (layer, KV head, block) scores lose that head's view of the
        block (a block goes when all its heads do) until the budget, counted in head shares (``device_load``),
        holds over all layers (global) or in each layer."""
        cache = view.cache
        layers, heads, n = mass.shape
        kv_heads = cache.num_kv_heads
        grouped = mass.reshape(layers, kv_heads, heads // kv_heads, n)
        per_kv = grouped.amax(dim=2) if self.aggregation == "max" else grouped.mean(dim=2)  # [L, KVH, N]
        candidates = (view.tier == Tier.DEVICE) & ~view.pinned & ~(view.first_position < self.n_sink)[None]
        candidates = candidates[:, None, :] & ~cache.head_dropped[:, :, :n]
        load = torch.tensor([cache.device_load(layer) for layer in range(layers)], dtype=torch.float64)
        keyed = torch.where(candidates, per_kv.double(), torch.tensor(float("inf"), dtype=torch.float64))
        # one pool of (layer, head, block) candidates under a global budget, one per layer otherwise
        pools = ([(list(range(layers)), view.total_budget)] if view.total_budget is not None
                 else [([layer], int(view.budget_blocks[layer])) for layer in range(layers)])
        chosen = []
        for members, budget in pools:
            units = math.ceil(kv_heads * (float(load[members].sum()) - budget) - 1e-6)
            order = torch.argsort(keyed[members].flatten(), stable=True)[: max(units, 0)]
            chosen += [(members[index // (kv_heads * n)], (index // n) % kv_heads, index % n) for index in order.tolist()]
        return [Decision(layer, block, Op.EVICT, head) for layer, head, block in chosen
                if bool(candidates[layer, head, block])]
