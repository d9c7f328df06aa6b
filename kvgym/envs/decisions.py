"""Recorded decision points for the ranking action (``cache.ranking``), and the one-step replay env over them.

**A decision point** (``decision_point``, ``collect``): for one sample, the ``oneshot-question`` protocol's one
decision (the prompt but its last token prefilled densely, so the question's queries are in the statistics):
every block's ``block_features`` there and its **future attention** per query head, ``[L, H, N]``: the mass
the full cache's last prompt token and greedy answer give each block. One ``.pt`` file per sample, written once
(a killed collection resumes where it stopped). With ``blind``, also the sample's **question-blind** decision
point (``oneshot``, kvpress's pipeline: the context alone prefilled; its future is the attention of the question,
the last prompt token and the answer), in a ``_blind`` file. With a ``teacher`` (a function of the decision's
``CacheView`` giving a score per query head and block, ``[L, H, N]``: KVzip's reconstruction attention, for
example; ``agents`` supplies it), the blind record also carries the teacher's scores (``teacher_heads``), in a
``_blind_<teacher>`` file: on question-blind decisions the future attention misleads (benchmarks/HISTORY.md, "the regret
misleads"), and a teacher that sees the whole context may not. Every record also names its sample's
``answer_blocks``: the blocks whose tokens state a gold answer in the context (the needle;
``eval.tasks.prompt.answer_positions``), which ``Decisions(needle_weight=...)`` can add to the target.

**Streaming states** (``streaming_state``): the same sample run under the ``streaming`` protocol (chunked
prefill, a budget, an optional host tier) with a *driver* controller deciding during the prefill; the block
features the ``question`` decision point shows (offloaded blocks have no fresh attention there, only their key
summaries), those of two ``prefill`` decision points (half and three quarters of the prompt read) and of the
first ``decode`` one, with the same full-cache future attention (cut to the blocks read by then: what the
question and answer will need). The driver's choices shape that state, so several drivers give the policy the
states it will meet when it drives the prefill itself (DAgger, one round). Such a record carries its own
``budgets`` (the one it ran at), ``phase`` and ``host_blocks``.

**A decision** (``Decisions``): one layer of one decision point at one budget (a fraction of the context).
Its reward is exact: ``-ranking_regret`` (``kvgym.envs.reward``), the future mass (max over query heads:
retrieval heads count) the kept set leaves off the device, minus the future-attention oracle's, over the
layer's total. Layers are independent once per-layer budgets are fixed, so a decision is a contextual bandit.

Records also carry each block's mean value norm per KV head (``value_norms``): ``Decisions(target="future_value")``
weighs the future attention by it. **The live reward** of a ranking at a recorded decision point, the
teacher-forced KL of the compressed cache's output from the full cache's, is ``LiveDecision``'s.

``RankingReplayEnv`` serves those decisions as one-step Gymnasium episodes: the observation is the layer's
block features (padded to ``max_blocks``) and its candidate mask, the action a keep score per block;
``agents.ranker.ppo.RankingReplayVecEnv`` steps many of them as one SB3 ``VecEnv`` batch (what PPO trains on).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from cache.controller import PHASES, CacheView, apply_decisions
from cache.paged_cache import CacheConfig
from cache.ranking import (
    BUDGET_COLUMN,
    PRESSURE_COLUMN,
    RANK_FEATURES,
    block_features,
    keep_top,
    policy_features,
    top_b,
)
from cache.runner import Runner, budget_blocks
from cache.tiers import Tier
from kvgym.envs.reward import kept_by_ranking, ranking_regret

BUDGETS = (0.125, 0.25, 0.5)


def block_value_norms(view: CacheView) -> torch.Tensor:
    """``[L, kv_heads, N]``: each device block's mean value norm (L2 over the head dimension, mean over its
    tokens) per KV head; 0 for blocks off the device."""
    cache = view.cache
    block_size = cache.block_size
    norms = None
    for layer in range(view.num_layers):
        blocks = torch.nonzero(view.tier[layer] == Tier.DEVICE).flatten()
        pool = cache.device_pool(layer)
        values = pool.values[cache.tables.physical[layer, blocks].to(pool.values.device)].float().cpu()  # [B, bs, kvh, d]
        if norms is None:
            norms = torch.zeros(view.num_layers, values.shape[2], view.num_blocks)
        valid = torch.arange(block_size)[None] < view.num_tokens[layer, blocks][:, None]  # [B, bs]
        # where, not a product: a partial block's unwritten slots hold whatever the pool's memory held (NaN too)
        per_token = torch.where(valid[..., None], values.norm(dim=-1), 0.0)
        norms[layer, :, blocks] = (per_token.sum(dim=1) / valid.sum(dim=1, keepdim=True).clamp(min=1)).T
    return norms


@torch.no_grad()
def decision_point(model, prompt, max_new_tokens: int, block_size: int = 16, eos_ids: set[int] | None = None,
                   shared=None, protocol: str = "oneshot-question", teacher=None) -> dict:
    """The one-shot decision point of ``prompt`` (a ``cache.runner.Prompt``): features (as the policy sees them,
    ``policy_features``), the full cache's future attention per query head, and the full cache's greedy answer.
    ``protocol``: ``oneshot-question`` (the prompt but its last token prefilled: the question read) or ``oneshot``
    (kvpress's pipeline: the context alone prefilled, a question-blind compression, whose future is the attention
    of the question, the last prompt token and the answer). ``shared``: a ``Runner.dense_prefill`` of the prompt
    under ``protocol`` to start from (a copy of it; default: prefill here). ``teacher``: a function of the
    decision's ``CacheView`` (with the model and the tokens read) → ``[L, H, N]`` scores, recorded as
    ``teacher_heads``."""
    if shared is None:
        runner = Runner(model, None, CacheConfig(block_size=block_size), protocol=protocol)
        shared = runner.dense_prefill(prompt, max_new_tokens)
    if shared.protocol != protocol:
        raise ValueError(f"decision_point: the shared prefill is {shared.protocol!r}'s, not {protocol!r}'s")
    cache = shared.cache.clone()
    block_size = cache.block_size
    num_layers = cache.num_layers
    budget = budget_blocks(0.25, prompt.context_tokens, block_size, num_layers, cache.config.sink_blocks + 1)
    view = CacheView.from_cache(cache, budget, phase="compress", model=model,
                                token_ids=torch.tensor(prompt.ids[: shared.dense_end], dtype=torch.long),
                                question_read=shared.dense_end > prompt.context_end)
    features = torch.from_numpy(policy_features(view))
    value_norms = block_value_norms(view)
    before = view.acc_mass_heads.clone()
    taught = {}
    if teacher is not None:
        taught["teacher_heads"] = teacher(view).float()
        if taught["teacher_heads"].shape != before.shape:
            raise ValueError(f"decision_point: the teacher gave scores of shape {tuple(taught['teacher_heads'].shape)}, "
                             f"expected [layers, query heads, blocks] = {tuple(before.shape)}")
    n = view.num_blocks
    device = next(model.parameters()).device
    rest = prompt.ids[shared.dense_end:-1]  # oneshot: the question and answer prefix, read after the decision
    for start in range(0, len(rest), 64):
        model(input_ids=torch.tensor([rest[start:start + 64]], device=device), cache=cache, use_cache=True,
              logits_to_keep=1)
    token, answer = prompt.ids[-1], []
    for _ in range(max_new_tokens):
        out = model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        answer.append(token)
        if eos_ids and token in eos_ids:
            break
    after = CacheView.from_cache(cache, budget, phase="decode").acc_mass_heads[:, :, :n]
    return {
        "features": features.half(), "future_heads": (after - before).float(), "context_tokens": prompt.context_tokens,
        "device_blocks": (view.tier == Tier.DEVICE).sum(dim=1), "sink_blocks": cache.config.sink_blocks,
        "block_size": block_size, "answer": torch.tensor(answer), "prefill_s": shared.seconds, "protocol": protocol,
        "value_norms": value_norms.half(), **taught,
    }


class LiveDecision:
    """A decision point's **live** reward, the teacher-forced KL: a ranking's scores (``[L, N]``, higher = keep)
    are applied to a copy of the dense prefill (``keep_top`` at ``budget``, a fraction of the context: the
    ``oneshot-question`` compression), then the last prompt token and the full cache's answer are fed in one
    forward; the result is the mean over the answer's positions of the KL from the full cache's next-token
    distributions there (what ``Runner.run(forced_tokens=answer, keep_logits=True)`` compares step by step).
    The reward the attention oracle cannot give: it scores what the compressed cache does to the output."""

    def __init__(self, model, prompt, shared, answer: list[int]):
        if shared.protocol != "oneshot-question" or shared.dense_end != len(prompt.ids) - 1:
            raise ValueError("LiveDecision: expected a oneshot-question dense prefill (the prompt but its last token)")
        if not answer:
            raise ValueError("LiveDecision: the answer to teacher-force is empty")
        self.model, self.prompt, self.shared = model, prompt, shared
        self.fed = torch.tensor([[prompt.ids[-1], *answer[:-1]]], device=next(model.parameters()).device)
        self.reference = self._log_probs(shared.cache.clone())

    @torch.no_grad()
    def _log_probs(self, cache) -> torch.Tensor:
        logits = self.model(input_ids=self.fed, cache=cache, use_cache=True, logits_to_keep=0).logits[0]
        return torch.log_softmax(logits.double().cpu(), dim=-1)

    @torch.no_grad()
    def kl(self, scores, budget: float) -> float:
        cache = self.shared.cache.clone()
        blocks = budget_blocks(budget, self.prompt.context_tokens, cache.block_size, cache.num_layers,
                               cache.config.sink_blocks + 1)
        view = CacheView.from_cache(cache, blocks, phase="compress", question_read=True)
        apply_decisions(cache, keep_top(view, scores))
        if cache.enforce_budget(blocks):
            raise RuntimeError("LiveDecision: keep_top left a layer over its budget")
        log_q = self._log_probs(cache)
        return float((self.reference.exp() * (self.reference - log_q)).sum(dim=-1).clamp_min(0.0).mean())


class _StateRecorder:
    """A streaming run's controller, wrapped: keeps the block features of the first ``question`` decision point,
    of the first ``prefill`` decision point at or past each of ``marks`` blocks, and of the first ``decode`` one."""

    def __init__(self, controller, marks: tuple[int, ...]):
        self.controller, self.marks = controller, list(marks)
        self.question, self.others = None, []

    def __getattr__(self, name):  # the runner reads a controller's options (fallback rule, layer budgets, ...)
        return getattr(self.controller, name)

    def decide(self, view: CacheView):
        take = (view.phase == "question" and self.question is None) or \
            (view.phase == "decode" and not any(s["phase"] == "decode" for s in self.others))
        if view.phase == "prefill" and self.marks and view.num_blocks >= self.marks[0]:
            self.marks.pop(0)
            take = True
        if take:
            state = {"features": torch.from_numpy(block_features(view)).half(),
                     "device_blocks": (view.tier == Tier.DEVICE).sum(dim=1), "phase": view.phase}
            if view.phase == "question":
                self.question = state
            else:
                self.others.append(state)
        return self.controller.decide(view)


@torch.no_grad()
def streaming_state(model, prompt, driver, budget: float, host_blocks: int, block_size: int = 16,
                    prefill_marks: tuple[float, ...] = (0.5, 0.75)) -> dict:
    """``prompt`` streamed at ``budget`` with ``driver`` deciding: the block features (and device blocks per
    layer) of its ``question`` decision point, and under ``other_states`` those of the prefill decision points
    where ``prefill_marks`` (fractions) of the prompt's blocks have been read and of the first decode decision
    (after the last prompt token, before the answer)."""
    total = math.ceil((len(prompt.ids) - 1) / block_size)
    recorder = _StateRecorder(driver, tuple(max(1, round(total * mark)) for mark in prefill_marks))
    runner = Runner(model, None, CacheConfig(block_size=block_size, host_blocks=host_blocks), controller=recorder,
                    budget=budget, protocol="streaming")
    runner.run(prompt, max_new_tokens=1)
    if recorder.question is None:
        raise ValueError("streaming_state: the prompt has no question decision point (no question part)")
    return {**recorder.question, "other_states": recorder.others, "budgets": [budget],
            "host_blocks": host_blocks, "protocol": "streaming"}


def driver_name(spec: str) -> str:
    """A driver's controller spec as it stands in ``collect``'s file names (``:`` and ``/`` made ``-``)."""
    return spec.replace(":", "-").replace("/", "-")


def collect(model, tokenizer, tasks: list[str], lengths: list[int], n: int, seed: int, out: str | Path,
            chat: bool = True, block_size: int = 16, max_new_tokens: int = 24, drivers: dict | None = None,
            streaming_budgets: tuple[float, ...] = (0.25,), host_blocks: int = 0, blind: bool = False,
            teacher: tuple[str, object] | None = None, blind_only: bool = False, log=print) -> list[Path]:
    """Decision points of ``n`` samples per task × length (task seed ``seed``) into ``out``, and for each of
    ``drivers`` (name → controller) the sample's streaming states with ``host_blocks`` host blocks per layer,
    at a budget of ``streaming_budgets`` (taken in turn by sample index); with ``blind``, the sample's
    question-blind (``oneshot``) decision point too, with ``teacher`` (``(name, function)``, see
    ``decision_point``) the teacher's scores in it; ``blind_only``: that one alone (no ``oneshot-question`` or
    streaming records); existing files are kept (resume)."""
    if blind_only and not blind:
        raise ValueError("collect: blind_only needs blind (the question-blind decision points)")
    if teacher is not None and not blind:
        raise ValueError("collect: a teacher scores the question-blind decision points: pass blind too")
    from eval.tasks import generate
    from eval.tasks.prompt import answer_positions, build_prompt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    paths = []
    for task in tasks:
        for length in lengths:
            for index in range(n):
                path = out / f"{task}_{length}_s{seed}_{index}.pt"
                budget = streaming_budgets[index % len(streaming_budgets)]
                streamed = {} if blind_only else \
                    {name: out / f"{path.stem}_streaming_{name}_b{budget}_h{host_blocks}.pt" for name in drivers or {}}
                suffix = "_blind" if teacher is None else f"_blind_{teacher[0]}"
                blind_paths = [out / f"{path.stem}{suffix}.pt"] if blind else []
                wanted = [*([] if blind_only else [path]), *streamed.values(), *blind_paths]
                paths += wanted
                done = [p for p in wanted if p.is_file()]
                if len(done) == len(wanted) and all(_has_answer_blocks(p) for p in done):
                    continue
                sample = generate(task, tokenizer, length, seed=seed, index=index)
                prompt = build_prompt(tokenizer, sample, chat)
                needle = {"answer_blocks": torch.tensor(sorted({i // block_size for i in
                                                                answer_positions(tokenizer, sample, chat)}))}
                for done_path in (p for p in done if not _has_answer_blocks(p)):  # files of an older kvgym
                    _save({**torch.load(done_path, weights_only=True), **needle}, done_path)
                start = time.perf_counter()
                if blind_only:
                    record = None
                elif path.is_file():
                    record = torch.load(path, weights_only=True)
                else:
                    record = decision_point(model, prompt, min(sample.max_new_tokens, max_new_tokens), block_size, eos)
                    record.update(task=task, length=length, seed=seed, index=index, **needle)
                    _save(record, path)
                for name, streamed_path in streamed.items():
                    if streamed_path.is_file():
                        continue
                    state = streaming_state(model, prompt, drivers[name], budget, host_blocks, block_size)
                    if state["features"].shape != record["features"].shape:
                        raise RuntimeError(f"{streamed_path.name}: the streaming state has "
                                           f"{tuple(state['features'].shape)} features, the full cache's "
                                           f"decision point {tuple(record['features'].shape)}")
                    _save({**record, **state, "driver": name}, streamed_path)
                for blind_path in (p for p in blind_paths if not p.is_file()):
                    blind_record = decision_point(model, prompt, min(sample.max_new_tokens, max_new_tokens), block_size,
                                                  eos, protocol="oneshot", teacher=None if teacher is None else teacher[1])
                    _save({**blind_record, "task": task, "length": length, "seed": seed, "index": index, **needle},
                          blind_path)
                    record = record or blind_record
                made = f"{record['features'].shape[1]} blocks" if record is not None else "answer blocks added"
                log(f"{path.stem}: {made}, {time.perf_counter() - start:.1f} s")
    return paths


def _has_answer_blocks(path: Path) -> bool:
    return "answer_blocks" in torch.load(path, weights_only=True, map_location="cpu")


def _save(record: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.replace(path)


TARGETS = {"future": "future_heads", "teacher": "teacher_heads", "teacher_kept": "teacher_heads",
           "future_value": "value_norms"}
TARGET_SOURCES = {  # where a record gets what each target needs
    "future": "every record has it",
    "teacher": "collect them with a teacher: `python -m benchmarks.ranker_tools collect --blind --teacher`",
    "teacher_kept": "collect them with a teacher: `python -m benchmarks.ranker_tools collect --blind --teacher`",
    "future_value": "recorded by `python -m benchmarks.ranker_tools collect` since value norms are: collect them again",
}


def target_heads(record: dict, target: str) -> torch.Tensor:
    """A record's ``[L, H, N]`` scores for ``target``: ``future`` (the future attention), ``teacher`` (the
    teacher's scores), ``future_value`` (the future attention times the block's mean value norm in the query
    head's KV group: what a lost block takes out of the attention output, not only its weight; records
    collected since the value norms are recorded)."""
    if target != "future_value":
        return record[TARGETS[target]].float()
    future, norms = record["future_heads"].float(), record["value_norms"].float()
    group = future.shape[1] // norms.shape[1]
    return future * norms.repeat_interleave(group, dim=1)[..., : future.shape[-1]]


def kept_share(scores: torch.Tensor, kv_heads: int, candidates: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """``[L, N]``: the share of each layer's KV heads that keep a block when the (layer, KV head, block) entries
    of ``scores`` (``[L, H, N]`` per query head; a KV head scores a block by the max over its query heads) compete
    for ``kv_heads × room.sum()`` places over all layers at once, the candidates only: kvpress's selection
    (``layerwise=False``, per KV head), which kvgym's KVzip follows (``agents.baselines.kvzip``), at the row's
    budget. Ties keep the earlier entry."""
    layers, heads, n = scores.shape
    per_kv = scores.reshape(layers, kv_heads, heads // kv_heads, n).amax(dim=2)
    entries = candidates[:, None, :].expand(layers, kv_heads, n)
    kept = top_b(per_kv.flatten()[None], entries.flatten()[None], kv_heads * room.sum()[None])  # one pool
    return kept.reshape(layers, kv_heads, n).float().mean(dim=1)


class Decisions:
    """Padded tensors of decision points × budgets, one row per (sample, budget, layer):
    ``features`` ``[R, N, F]``, ``mass`` ``[R, N]`` (the ``target``'s scores, max over query heads: the future
    attention, or the teacher's scores of a record collected with one; ``teacher_kept``: the share of the layer's
    KV heads that keep the block when kvpress's rule selects on the teacher's scores at the row's budget,
    ``kept_share``; with ``needle_weight`` w > 0 each layer's
    target is normalised to sum 1 and its ``answer_blocks`` share w more among them: the needle is worth w times
    the rest of the layer), ``candidates``
    ``[R, N]`` (valid, not pinned), ``room`` ``[R]`` (blocks kept besides the pinned), ``budget`` ``[R]``,
    ``phase`` ``[R]`` (the decision point's phase, an index into ``PHASES``: ``compress`` for one-shot records),
    ``sample`` ``[R]`` (which task sample the row came from, numbered in order of appearance: a sample's
    one-shot record and its streaming states share it, so statistics can resample whole samples)."""

    def __init__(self, records: list[dict], budgets=BUDGETS, target: str = "future", needle_weight: float = 0.0):
        if target not in TARGETS:
            raise ValueError(f"Decisions target: expected one of {', '.join(TARGETS)}, got {target!r}")
        if not records:
            raise ValueError("Decisions: no records (collect some with `python -m benchmarks.ranker_tools collect`)")
        if not needle_weight >= 0:
            raise ValueError(f"Decisions needle_weight: expected a weight >= 0, got {needle_weight!r}")
        if needle_weight and any("answer_blocks" not in r for r in records):
            raise ValueError("Decisions needle_weight: records without answer_blocks (collected by an older kvgym: "
                             "rerun `python -m benchmarks.ranker_tools collect` on their folder, it adds them)")
        untaught = sum(TARGETS[target] not in r for r in records)
        if untaught:
            raise ValueError(f"Decisions target {target!r}: {untaught} of {len(records)} records have no "
                             f"{TARGETS[target]} ({TARGET_SOURCES[target]})")
        width = max(int(r["features"].shape[1]) for r in records)
        rows = {"features": [], "mass": [], "candidates": [], "room": [], "budget": [], "phase": [], "sample": []}
        samples: dict[tuple, int] = {}
        for record in records:
            sample = samples.setdefault(tuple(record.get(k) for k in ("task", "length", "seed", "index")), len(samples))
            features = record["features"].float()
            num_layers, n, _ = features.shape
            pinned = torch.zeros(n, dtype=torch.bool)
            pinned[: int(record["sink_blocks"])] = True
            pinned[n - 1] = True
            valid = features[..., RANK_FEATURES.index("valid")] > 0
            candidates = valid & ~pinned
            heads = target_heads(record, target)  # [L, H, N]
            if target != "teacher_kept":  # the same for every budget
                mass = _with_needle(heads.amax(dim=1), record, needle_weight)
            for fraction in record.get("budgets", budgets):
                blocks = torch.tensor(budget_blocks(fraction, int(record["context_tokens"]), int(record["block_size"]),
                                                    num_layers, int(record["sink_blocks"]) + 1))
                room = (blocks - (valid & pinned).sum(dim=1)).clamp(min=0)
                if target == "teacher_kept":  # which blocks kvpress's rule keeps depends on the budget
                    mass = _with_needle(kept_share(heads, record["value_norms"].shape[1], candidates, room), record,
                                        needle_weight)
                x = features.clone()
                x[..., BUDGET_COLUMN] = (blocks / n)[:, None]
                x[..., PRESSURE_COLUMN] = (record["device_blocks"] / blocks.clamp(min=1))[:, None]
                pad = width - n
                rows["features"].append(torch.nn.functional.pad(x, (0, 0, 0, pad)))
                rows["mass"].append(torch.nn.functional.pad(mass, (0, pad)))
                rows["candidates"].append(torch.nn.functional.pad(candidates, (0, pad)))
                rows["room"].append(room)
                rows["budget"].append(torch.full((num_layers,), fraction))
                rows["phase"].append(torch.full((num_layers,), PHASES.index(record.get("phase", "compress"))))
                rows["sample"].append(torch.full((num_layers,), sample))
        self.features = torch.cat(rows["features"])
        self.mass = torch.cat(rows["mass"])
        self.candidates = torch.cat(rows["candidates"])
        self.room = torch.cat(rows["room"])
        self.budget = torch.cat(rows["budget"])
        self.phase = torch.cat(rows["phase"])  # index into cache.controller.PHASES
        self.sample = torch.cat(rows["sample"])

    def __len__(self) -> int:
        return int(self.room.shape[0])

    def kept(self, scores: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        """``[R, N]`` bool: the candidates the top-b of ``scores`` keeps (the pinned blocks are kept besides)."""
        return kept_by_ranking(scores, self.room[rows], self.candidates[rows])

    def regret(self, scores: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        return ranking_regret(scores, self.mass[rows], self.room[rows], self.candidates[rows])

    def regret_by(self, scores: torch.Tensor) -> dict[str, float]:
        """Mean regret of the deterministic top-b of ``scores`` per budget, per phase and over all rows."""
        regret = self.regret(scores)
        table = {str(b): float(regret[self.budget == b].mean()) for b in sorted(set(self.budget.tolist()))}
        table |= {phase: float(regret[self.phase == i].mean()) for i, phase in enumerate(PHASES)
                  if (self.phase == i).any()}
        table["all"] = float(regret.mean())
        return table


def _with_needle(mass: torch.Tensor, record: dict, needle_weight: float) -> torch.Tensor:
    """``mass`` (``[L, N]``) with each layer normalised to sum 1 and its ``answer_blocks`` sharing
    ``needle_weight`` more (unchanged when the weight is 0)."""
    if not needle_weight:
        return mass
    mass = mass.clamp(min=0) / mass.clamp(min=0).sum(dim=1, keepdim=True).clamp(min=1e-12)
    needle = record["answer_blocks"].long()
    needle = needle[needle < mass.shape[1]]
    if len(needle):
        mass[:, needle] += needle_weight / len(needle)
    return mass


def load_records(paths: list[Path]) -> list[dict]:
    """The records of ``collect``'s files; a streaming file gives its question state and each of its other
    states (the future attention cut to the blocks read by then, or padded with zeros for a block begun since)."""
    records = []
    for path in paths:
        try:
            record = torch.load(path, weights_only=True)
        except Exception as error:  # noqa: BLE001  (torch raises many kinds for a damaged or foreign file)
            raise ValueError(f"{path}: not a decision point of `python -m benchmarks.ranker_tools collect` ({type(error).__name__}); "
                             "remove it or collect it again (a rerun of collect rewrites missing files)") from None
        if not isinstance(record, dict) or not {"features", "future_heads", "context_tokens"} <= set(record):
            raise ValueError(f"{path}: not a decision point of `python -m benchmarks.ranker_tools collect` (no features / future_heads); "
                             "remove it or collect it again")
        if record["features"].shape[-1] != len(RANK_FEATURES):
            raise ValueError(f"{path}: collected with {record['features'].shape[-1]} block features, this kvgym "
                             f"computes {len(RANK_FEATURES)} (RANK_FEATURES changed since); collect again into a "
                             "new folder")
        others = record.pop("other_states", [])
        records.append(record)
        for state in others:
            future = record["future_heads"]
            blocks = state["features"].shape[1]
            future = future[..., :blocks] if blocks <= future.shape[-1] else \
                torch.nn.functional.pad(future, (0, blocks - future.shape[-1]))
            records.append({**record, **state, "future_heads": future})
    return records


def keep_scores(action, shape: tuple[int, ...], name: str) -> np.ndarray:
    """``action`` as float32 keep scores of ``shape`` (one per block; per env first when batched), all finite;
    else a ValueError that names ``name`` and the shape expected."""
    action = np.asarray(action, np.float32)
    if action.shape != shape or not np.isfinite(action).all():
        raise ValueError(f"{name}: expected {shape} finite keep scores (one per block), got shape {action.shape}")
    return action


class RankingReplayEnv(gym.Env):
    """One-step episodes over recorded decisions: observe one layer's blocks, score them, get ``-regret``.

    ``observation``: ``blocks`` ``[max_blocks, F]`` (``RANK_FEATURES``; padding rows are 0) and
    ``candidates`` ``[max_blocks]`` (1 = may be kept or evicted; pinned and padding rows are 0).
    ``action``: a keep score per block (``Box(-score_bound, score_bound)``, default ``[-1, 1]``; only their
    order matters: the kept set is the top ``room`` candidates; a policy whose scores are unbounded logits, such
    as the ranker's, takes a wide bound so that SB3's clipping to the box leaves their order alone).
    ``reward``: ``-ranking_regret`` (0 = the future-attention oracle's choice); ``info`` has the regret, the
    budget and the decision's index. Episodes are drawn uniformly (``reset(seed=...)`` seeds the draw).
    """

    metadata = {"render_modes": []}

    def __init__(self, decisions: Decisions, max_blocks: int | None = None, score_bound: float = 1.0):
        if not (math.isfinite(score_bound) and score_bound > 0):
            raise ValueError(f"score_bound: expected a finite bound > 0 on the keep scores, got {score_bound!r}")
        self.decisions = decisions
        self.max_blocks = max_blocks or int(decisions.features.shape[1])
        if self.max_blocks < decisions.features.shape[1]:
            raise ValueError(f"max_blocks {self.max_blocks} is below the decisions' {decisions.features.shape[1]} blocks")
        big = 1e4
        self.observation_space = spaces.Dict({
            "blocks": spaces.Box(-big, big, (self.max_blocks, len(RANK_FEATURES)), np.float32),
            "candidates": spaces.Box(0.0, 1.0, (self.max_blocks,), np.float32),
        })
        # only the order of the scores matters: [-1, 1] suits a Gaussian policy (any finite score is accepted)
        self.action_space = spaces.Box(-score_bound, score_bound, (self.max_blocks,), np.float32)
        self._row = None

    def _observation(self) -> dict[str, np.ndarray]:
        width = self.decisions.features.shape[1]
        blocks = np.zeros((self.max_blocks, len(RANK_FEATURES)), np.float32)
        candidates = np.zeros(self.max_blocks, np.float32)
        blocks[:width] = self.decisions.features[self._row].numpy()
        candidates[:width] = self.decisions.candidates[self._row].numpy()
        return {"blocks": blocks, "candidates": candidates}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        row = (options or {}).get("row", self.np_random.integers(len(self.decisions)))
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < len(self.decisions):
            raise ValueError(f"RankingReplayEnv.reset: options['row'] {row!r} must be a row index in "
                             f"0..{len(self.decisions) - 1}")
        self._row = int(row)
        return self._observation(), {"row": self._row, "budget": float(self.decisions.budget[self._row])}

    def step(self, action):
        if self._row is None:
            raise RuntimeError("RankingReplayEnv.step before reset (or after the episode ended): call reset() first")
        action = keep_scores(action, (self.max_blocks,), "action")
        width = self.decisions.features.shape[1]
        row, observation = self._row, self._observation()
        regret = float(self.decisions.regret(torch.from_numpy(action[None, :width]), slice(row, row + 1))[0])
        self._row = None  # one step per episode
        return observation, -regret, True, False, {"regret": regret, "row": row,
                                                   "budget": float(self.decisions.budget[row])}
