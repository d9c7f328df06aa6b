"""The evaluation harness: tasks × lengths × samples, each run with the full cache and every controller × budget.

``evaluate(model, tokenizer, controllers, budgets, tasks, lengths, n, seed, out_dir)`` writes into ``out_dir``:

- ``samples.jsonl``: one JSON object per run (``RECORD_FIELDS``), appended and flushed as each run ends;
- ``summary.csv`` / ``summary.md``, ``accuracy_vs_budget.png``, ``bytes_vs_context.png`` (``eval/report.py``);
- ``eval_config.json``: the settings that change what a run computes (model, chat, tiers, chunking); a
  rerun into the same folder with different settings is refused.
- ``references/``: the full cache's first-position logits of each answer-task sample (resuming, below).

Design:

- **Samples.** Sample ``index`` of ``task`` at ``length`` comes from the task's registered generator
  (``eval.tasks.base.TASKS``; ``eval.tasks.<name>`` is imported on first use) with the seed
  ``sample_seed(seed, task, length, index)``: the first 31 bits of sha256 of ``"seed:task:length:index"``.
  The same ``seed`` gives the same samples on every machine and Python; another ``seed`` gives fresh ones.
- **Prompt.** ``eval.tasks.prompt.build_prompt``: the chat template around the input as the user turn
  (``chat=True``), the answer prefix opening the reply, and the token where the context ends (the
  protocols compress the context and count the budget from it). Natural-text samples (metric ``kl``) are
  never wrapped: their prompt is plain text and the continuation is teacher-forced after it.
- **Protocol** (``protocol``, ``decode_budget``, ``budget_scope``; ``cache.runner`` documents each): ``streaming``,
  ``oneshot``, ``oneshot-question`` or ``multiturn``. In the one-shot protocols a sample's dense prefill is
  computed once and every run (the full cache's included) continues from its own copy of it
  (``share_prefill=False`` recomputes it per run: same results, for the throughput benchmark).
- **Multi-turn** samples are answered turn by turn (``multiturn``: streamed under one budget; ``oneshot`` /
  ``oneshot-question``: compressed once, then the turns on the grown cache); ``turn_scores`` holds each turn's
  score and ``score`` their mean. ``streaming`` refuses them.
- **Runs.** For each sample the full cache runs first (the reference: it calibrates accuracy and gives the
  reference logits), then every controller at every budget (``full`` once, recorded with budget 1.0; it is
  always run, whether or not ``controllers`` names it). A fresh controller is built per run from its
  registry spec; ``oracle`` is built per sample from a full-cache trace of the same tokens
  (``Oracle.from_run``; for teacher-forced samples the trace follows the forced continuation). Decoding is
  greedy, stopping at EOS or after ``sample.max_new_tokens``.
- **Scores.** Answer tasks: ``eval.tasks.scoring.score(sample, text)``. Natural text (metric ``kl``): the
  continuation (``continuation_ids``: its tokens as they follow the prompt in running text) is
  teacher-forced (``Runner.run(forced_tokens=...)``) and ``score`` is the top-1 accuracy
  of the model's next-token prediction over it; ``perplexity`` is recorded as well.
- **KL.** ``kl = KL(P_full || P_controller)`` in nats of the next-token distributions at the first generated
  position (both runs have seen the same prompt; only the cache differs). For natural text it is the mean
  over every teacher-forced position. The full cache's own ``kl`` is 0.
- **Costs.** ``bytes_read_per_token``: attention bytes read per decode step (all layers, the runner's
  mean); ``bytes_moved_per_token``: bytes moved between tiers over the whole run (prefill + decode) per
  generated token; ``decode_ms_per_token`` and ``ttft_ms`` are wall times (not deterministic).
- **Resuming.** A run whose key ``(controller, budget, task, length, index, seed, sample_hash)`` is already in
  ``samples.jsonl`` is skipped. ``sample_hash`` is a hash of the sample's text, answer prefix, gold answers
  and turns, so a sample whose content changed (an edited tasks file, a changed generator) runs again and
  its old rows are not reported. A controller whose spec names a file (a policy: ``ranker:policies/x.pt``)
  records the file's digest (``controller_digest``); its records count as done only while the file is the
  same, so a retrained policy evaluated into the same folder runs again (with a warning). When only
  some of a sample's runs are missing, the full-cache reference's logits are needed again (for ``kl``): an answer
  task's first-position logits are kept in ``references/<sample_hash>.pt`` when the reference first runs
  (``eval.records.save_reference``), so a later run into the folder (another controller, another budget) reads
  them instead of running the full cache again, which halves the cost of adding one controller to a folder; a
  teacher-forced sample (metric ``kl``, logits at every position) runs the reference again (deterministic). A
  truncated last line (an interrupted write) is dropped with a warning; any other unreadable line is an error
  naming it.
- **Custom samples** (``tasks_file``, or ``dataset`` read through ``datasets``: ``eval.datasets``): one JSON
  object per line (``read_tasks_file``); the task name is the file's stem (a dataset's ``task`` column), ``index`` the sample's position in the file (blank lines skipped), ``length`` the prompt's
  token count rounded up to a power of two (the bucket the tables group by; ``prompt_tokens`` keeps the
  exact count) and ``seed`` the run's seed (it draws nothing).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.inputs import FULL, check_inputs, length_bucket, read_tasks_file, task_generator, tasks_file_task
from eval.records import (
    KEY_FIELDS,
    append_record,
    check_config,
    controller_digest,
    exclusive_folder,
    load_records,
    load_reference,
    sample_hash,
    save_reference,
)
from eval.tasks.base import sample_seed

FULL_BUDGET = 1.0






# ---------------------------------------------------------------- prompts and metrics


def prompt_ids(tokenizer, sample, chat: bool = True) -> list[int]:
    """The sample's prompt token ids (``eval.tasks.prompt.build_prompt``)."""
    from eval.tasks.prompt import build_prompt

    return build_prompt(tokenizer, sample, chat).ids


def encode(tokenizer, text: str, special: bool = True) -> list[int]:
    """Token ids of ``text`` (``eval.tasks.prompt.encode``)."""
    from eval.tasks.prompt import encode as encode_text

    return encode_text(tokenizer, text, special)


def continuation_ids(tokenizer, sample) -> list[int]:
    """The tokens of ``sample.continuation`` as they follow the prompt in running text:
    ``tokens(prompt + continuation)[len(tokens(prompt)):]`` when the prompt's tokens are a prefix of the
    joint ones (the usual case at a word boundary), else the continuation tokenized on its own."""
    prompt = encode(tokenizer, sample.prompt)
    joint = encode(tokenizer, sample.prompt + sample.continuation)
    if joint[: len(prompt)] == prompt and len(joint) > len(prompt):
        return joint[len(prompt):]
    return encode(tokenizer, sample.continuation, special=False)


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(reference) || softmax(other))`` in nats along the last dimension (float64)."""
    log_p = torch.log_softmax(reference.double().cpu(), dim=-1)
    log_q = torch.log_softmax(other.double().cpu(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


def score_sample(sample, text: str) -> float:
    """The task score of ``text`` for ``sample`` (``eval.tasks.scoring.score``)."""
    from eval.tasks.scoring import score

    return float(score(sample, text))


# ---------------------------------------------------------------- the run


@dataclass
class _Work:
    task: str
    length: int
    index: int
    sample: object | None = None  # custom samples are made up front; task samples on demand


class _Context:
    def __init__(self, model, tokenizer, chat, host_blocks, block_size, prefill_chunk, decide_every,
                 protocol="streaming", decode_budget="grow", share_prefill=True, budget_scope=None, batch_runs=False):
        from cache.paged_cache import CacheConfig
        from cache.sentences import sentence_end_token_ids

        self.model, self.tokenizer, self.chat = model, tokenizer, chat
        self.cache_config = CacheConfig(block_size=block_size, host_blocks=host_blocks)
        self.prefill_chunk, self.decide_every = prefill_chunk, decide_every
        self.protocol, self.decode_budget, self.share_prefill = protocol, decode_budget, share_prefill
        self.budget_scope, self.batch_runs = budget_scope, batch_runs
        # the vocabulary scan is done once here rather than by every Runner
        self.sentence_end_ids = sentence_end_token_ids(tokenizer) if hasattr(tokenizer, "get_vocab") else None
        self.shared = None  # the current sample's dense prefill (one-shot protocols)

    def runner(self, controller, budget, protocol=None):
        from cache.runner import Runner

        runner = Runner(self.model, None, self.cache_config, controller=controller, budget=budget,
                        prefill_chunk=self.prefill_chunk, decide_every=self.decide_every,
                        protocol=protocol or self.protocol, decode_budget=self.decode_budget,
                        budget_scope=self.budget_scope)
        runner.tokenizer, runner.sentence_end_ids = self.tokenizer, self.sentence_end_ids
        return runner

    def start_sample(self, prompt, sample, forced) -> None:
        """Compute the sample's dense prefill once (one-shot protocols with sharing on)."""
        self.shared = None
        if self.share_prefill and self.protocol in ("oneshot", "oneshot-question"):
            max_new = len(forced) if forced else sample.max_new_tokens
            self.shared = self.runner(None, None).dense_prefill(prompt, max_new)

    def run(self, controller, budget, prompt, sample, forced):
        runner = self.runner(controller, budget)
        result = runner.run(prompt, max_new_tokens=sample.max_new_tokens, keep_logits=True, forced_tokens=forced,
                            shared=self.shared)
        if result.cache is not None:
            result.cache.close()
            result.cache = None
        return result

    def run_together(self, runs, prompt, sample, forced):
        """``run`` for several ``(controller, budget)`` at once: their forwards batched (``cache.driving.run_batched``)."""
        from cache.driving import run_batched

        steps = [self.runner(controller, budget).steps(prompt, max_new_tokens=sample.max_new_tokens, keep_logits=True,
                                                       forced_tokens=forced, shared=self.shared)
                 for controller, budget in runs]
        results = run_batched(steps)
        for result in results:
            if result.cache is not None:
                result.cache.close()
                result.cache = None
        return results

    def oracle(self, spec, prompt, sample, forced):
        from agents.baselines.oracle import TraceRecorder
        from agents.registry import make_controller
        from cache.paged_cache import CacheConfig
        from cache.runner import Runner

        oracle = make_controller(spec)
        config = CacheConfig(**{**self.cache_config.__dict__,
                                "stats_window": max(self.cache_config.stats_window, self.prefill_chunk)})
        total = len(prompt.ids) + (len(forced) if forced else sample.max_new_tokens)
        recorder = TraceRecorder()
        # a full-cache streaming pass over the same tokens records every forward's attention
        runner = Runner(self.model, None, config, controller=recorder,
                        budget=max(-(-total // config.block_size), config.sink_blocks + 1),
                        prefill_chunk=self.prefill_chunk, decide_every=1, protocol="streaming")
        runner.sentence_end_ids = self.sentence_end_ids
        result = runner.run(prompt, max_new_tokens=sample.max_new_tokens, forced_tokens=forced)
        if result.cache is not None:
            result.cache.close()
        oracle.trace = recorder.trace(result.new_tokens)
        return oracle


def _record(key: dict, sample, sample_seed_value, result, reference, forced, protocol) -> dict:
    if forced is not None:
        logits = torch.stack([t.cpu() for t in result.logits])
        targets = torch.tensor(forced[: len(logits)])
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        nll = -log_probs.gather(1, targets[:, None]).squeeze(1)
        score = float((logits.argmax(dim=-1) == targets).double().mean())
        turn_scores = None
        perplexity = float(torch.exp(nll.mean()))
        ref = torch.stack([t.cpu() for t in reference.logits])
        kl = float(kl_divergence(ref, logits).mean())
    else:
        texts = result.turn_texts or [result.text]
        turn_scores = [score_sample(_turn_view(sample, number), text or "") for number, text in enumerate(texts)]
        score = sum(turn_scores) / len(turn_scores)
        turn_scores = turn_scores if sample.turns else None
        perplexity = None
        kl = float(kl_divergence(reference.logits[0], result.logits[0]))
    moved = sum(result.bytes_moved.values()) if result.bytes_moved else 0
    generated = max(sum(len(t) for t in result.turn_tokens) or len(result.new_tokens), 1)
    return {
        **key, "protocol": protocol, "sample_seed": sample_seed_value, "metric": sample.metric,
        "prompt_tokens": result.prompt_tokens, "context_tokens": result.context_tokens,
        "new_tokens": len(result.new_tokens),
        "text": None if forced is not None else (result.text if not sample.turns else result.turn_texts),
        "score": score, "turn_scores": turn_scores, "kl": kl, "perplexity": perplexity,
        "bytes_read_per_token": float(result.bytes_read_per_token),
        "bytes_moved_per_token": moved / generated,
        "decode_ms_per_token": round(result.decode_ms_per_token, 3), "ttft_ms": round(1000 * result.ttft_s, 3),
        "fallbacks": result.fallbacks,
        "budget_blocks": result.budget_blocks[0] if result.budget_blocks else None,
        "peak_device_blocks": result.peak_device_blocks,
        "operations": {k: v for k, v in sorted(result.operations.items()) if v},
    }


def _turn_view(sample, number: int):
    """What turn ``number`` (0 = the first) is scored against: the sample, or a copy with the turn's answers."""
    if number == 0:
        return sample
    return {"metric": sample.metric, "outputs": sample.turns[number - 1].outputs, "task": sample.task}


def evaluate(model, tokenizer, controllers, budgets, tasks, lengths, n: int, seed: int, out_dir: str | Path, *,
             tasks_file: str | Path | None = None, dataset: str | None = None, dataset_split: str | None = None,
             chat: bool = True, host_blocks: int = 0, block_size: int = 16, prefill_chunk: int = 64,
             decide_every: int = 8, protocol: str = "streaming", decode_budget: str = "grow",
             budget_scope: str | None = None, share_prefill: bool = True, model_name: str | None = None, progress: bool = True,
             plots: bool = True, ray: dict | None = None, batch_runs: bool = False) -> list[dict]:
    """Run the evaluation (see the module docstring) and write the files; returns the summary rows.

    ``controllers`` are registry specs (a list, or one comma-separated string), ``budgets`` fractions in
    (0, 1] of each sample's context, ``tasks`` registered task names (``None``: only ``tasks_file`` /
    ``dataset``), ``lengths`` target prompt lengths in tokens, ``n`` samples per task and length (and the
    most samples taken from a dataset). ``ray`` (a dict: ``address``, ``workers``, and the ``model`` name,
    ``device`` and ``dtype`` each worker loads; ``eval.ray_eval``) sends each sample's runs to a Ray cluster instead.
    ``batch_runs`` runs a sample's controllers and budgets in lockstep with their forwards batched
    (``cache.driving.run_batched``: the same answers up to float rounding; time fields are the shared forwards').
    """
    from tqdm import tqdm

    from cache.runner import BUDGET_SCOPES, DECODE_BUDGETS, PROTOCOLS
    from eval import report

    max_positions = int(getattr(model.config, "max_position_embeddings", 0)) or None
    if tasks is None and tasks_file is None and dataset is None:
        raise ValueError("--tasks: give at least one task, a --tasks-file or a --dataset")
    specs, budget_list, task_list, length_list = check_inputs(controllers, budgets, tasks, lengths, n, max_positions)
    if protocol not in PROTOCOLS:
        raise ValueError(f"--protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    if decode_budget not in DECODE_BUDGETS:
        raise ValueError(f"--decode-budget {decode_budget!r}: choose one of {', '.join(DECODE_BUDGETS)}")
    if budget_scope is not None and budget_scope not in BUDGET_SCOPES:
        raise ValueError(f"--budget-scope {budget_scope!r}: choose one of {', '.join(BUDGET_SCOPES)}")
    check_protocol(specs, protocol)
    if host_blocks < 0:
        raise ValueError(f"--host-blocks: must be >= 0, got {host_blocks}")
    if prefill_chunk < 1 or decide_every < 1:
        raise ValueError(f"--prefill-chunk and --decide-every must be >= 1, got {prefill_chunk}, {decide_every}")
    generators = {task: task_generator(task) for task in task_list}

    work: list[_Work] = [_Work(task, length, index) for task in task_list for length in length_list
                         for index in range(n)]
    custom = []
    if tasks_file is not None:
        from eval.tasks.base import Sample

        stem = tasks_file_task(tasks_file)
        if stem in task_list:
            raise ValueError(f"--tasks-file: its task name {stem!r} (the file's stem) is also in --tasks; rename the file")
        for index, entry in enumerate(read_tasks_file(tasks_file)):
            custom.append(Sample(task=stem, length=0, seed=seed, index=index, input=entry["input"],
                                 question=entry["question"], answer_prefix=entry["answer_prefix"],
                                 outputs=entry["outputs"], metric=entry["metric"],
                                 max_new_tokens=entry["max_new_tokens"], meta={"line": entry["line"]}))
    if dataset is not None:
        from eval.datasets import load_samples

        custom += load_samples(dataset, split=dataset_split, limit=n)
    for sample in custom:
        if sample.turns and protocol == "streaming":
            raise ValueError(f"sample {sample.task}/{sample.index} has {len(sample.turns) + 1} turns: "
                             "use --protocol multiturn (or oneshot: compressed once)")
        sample.length = length_bucket(len(prompt_ids(tokenizer, sample, chat)))
        work.append(_Work(sample.task, sample.length, sample.index, sample))

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: a file is there; give a folder (new or one written by kvgym eval)")
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_folder(out):
        name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        check_config(out, {"model": name, "chat": chat, "host_blocks": host_blocks, "block_size": block_size,
                            "prefill_chunk": prefill_chunk, "decide_every": decide_every, "protocol": protocol,
                            "decode_budget": decode_budget, "budget_scope": budget_scope})
        samples_path = out / "samples.jsonl"
        if not samples_path.exists() and (out / "samples.jsonl.gz").exists():
            raise ValueError(f"{out} holds compressed records (samples.jsonl.gz): gunzip it to add runs to them, or "
                             "use a fresh --out")
        done = load_records(samples_path)

        runs = [(FULL, FULL_BUDGET)] + [(spec, budget) for spec in specs if spec != FULL for budget in budget_list]
        digests = {spec: controller_digest(spec) for spec, _ in runs}
        stale = Counter()  # records of this run's controllers made with another version of the file they name
        for key, record in list(done.items()):
            if key[0] in digests and record.get("controller_digest") != digests[key[0]]:
                stale[key[0]] += 1
                del done[key]
        for spec, count in stale.items():
            warnings.warn(f"{samples_path}: {count} records of {spec} were made with another version of the file it "
                          "names (or before digests were recorded); those runs go again", stacklevel=2)
        context = _Context(model, tokenizer, chat, host_blocks, block_size, prefill_chunk, decide_every, protocol,
                           decode_budget, share_prefill, budget_scope, batch_runs)
        wanted: list[tuple] = []
        bar = tqdm(total=len(work) * len(runs), desc="kvgym eval", unit="run", **({} if progress else {"disable": True}))
        try:
            pending = []
            for item in work:
                sample, sample_seed_value = _make_sample(context, item, generators, seed)
                keys = [(spec, budget, item.task, item.length, item.index, seed, sample_hash(sample))
                        for spec, budget in runs]
                wanted += keys
                missing = [key for key in keys if key not in done]
                bar.update(len(keys) - len(missing))
                if not missing:
                    continue
                if ray is not None:  # sent to the cluster below, as items: workers make their own samples
                    pending.append((item, seed, missing))
                    continue
                for key, record in sample_records(context, item, sample, sample_seed_value, missing, bar, out):
                    _keep(key, record, done, samples_path, digests)
                    bar.update(1)
            if pending:
                from eval.ray_eval import run_on_ray

                settings = {"chat": chat, "host_blocks": host_blocks, "block_size": block_size,
                            "prefill_chunk": prefill_chunk, "decide_every": decide_every, "protocol": protocol,
                            "decode_budget": decode_budget, "share_prefill": share_prefill,
                            "budget_scope": budget_scope, "batch_runs": batch_runs}
                for key, record in run_on_ray(ray, settings, pending):
                    _keep(key, record, done, samples_path, digests)
                    bar.update(1)
        finally:
            bar.close()

        records = [done[key] for key in wanted]
        return report.write_report(records, out, plots=plots)


def check_protocol(specs: list[str], protocol: str) -> None:
    """Refuse a controller that cannot run under ``protocol`` (a controller lists what it supports in
    ``protocols``; the default is every protocol)."""
    from agents.registry import controller_class, parse_spec

    for spec in specs:
        supported = getattr(controller_class(parse_spec(spec)[0]), "protocols", None)
        if supported is not None and protocol not in supported:
            raise ValueError(f"--controllers: {spec} cannot run under --protocol {protocol} "
                             f"(it supports {', '.join(supported)})")


def _make_sample(context: _Context, item: _Work, generators: dict, seed: int):
    if item.sample is not None:
        return item.sample, None
    sample_seed_value = sample_seed(seed, item.task, item.length, item.index)
    return generators[item.task](context.tokenizer, item.length, sample_seed_value, item.index), sample_seed_value


def sample_records(context: _Context, item: _Work, sample, sample_seed_value, keys: list[tuple], bar=None,
                   references: Path | None = None):
    """Run one sample's ``keys`` (the full cache first, as the reference; one-shot protocols share its dense
    prefill) and yield ``(key, record)`` as each run ends. The same code serves a local run and a Ray worker. With
    ``references`` (the eval folder), an answer task's reference logits are read from there when the full cache's
    own run is not among ``keys``, and kept there when it runs (``save_reference``)."""
    from agents.registry import make_controller, parse_spec
    from eval.tasks.prompt import build_prompt

    where = f"task {item.task} length {item.length} sample {item.index}"
    if sample.metric == "kl":
        if not sample.continuation:
            raise ValueError(f"{where}: a 'kl' sample needs a continuation to teacher-force")
        forced = continuation_ids(context.tokenizer, sample)
        if not forced:
            raise ValueError(f"{where}: the continuation has no tokens")
        sample.max_new_tokens = len(forced)
    else:
        forced = None
    prompt = build_prompt(context.tokenizer, sample, context.chat)
    oracles: dict[str, object] = {}  # one trace per sample, shared by every budget
    saved = references is not None and forced is None
    reference, hash_value = None, dict(zip(KEY_FIELDS, keys[0], strict=True))["sample_hash"]
    if saved and all(key[0] != FULL for key in keys):
        first_logits = load_reference(references, hash_value)
        reference = None if first_logits is None else _SavedReference([first_logits])
    try:
        context.start_sample(prompt, sample, forced)
        if reference is None:
            reference = context.run(None, None, prompt, sample, forced)
            if saved:
                save_reference(references, hash_value, reference.logits[0])
    except ValueError as err:
        raise ValueError(f"{where}, full cache: {err}") from None
    def controller_of(spec, budget):
        try:
            if parse_spec(spec)[0] != "oracle":
                return make_controller(spec)
            if spec not in oracles:
                oracles[spec] = context.oracle(spec, prompt, sample, forced)
            return oracles[spec]
        except ValueError as err:
            raise ValueError(f"{where}, controller {spec} at budget {budget:g}: {err}") from None

    try:
        together = {}
        if context.batch_runs:  # every run of the sample in lockstep, their forwards batched
            batch = [key for key in keys if key[0] != FULL]
            try:
                results = context.run_together([(controller_of(*key[:2]), key[1]) for key in batch], prompt, sample,
                                               forced)
            except ValueError as err:
                spec, budget = batch[getattr(err, "run_index", 0)][:2]
                raise ValueError(f"{where}, controller {spec} at budget {budget:g}: {err}") from None
            together = dict(zip(batch, results, strict=True))
        for key in keys:
            spec, budget = key[0], key[1]
            if bar is not None:
                bar.set_postfix_str(f"{item.task}/{item.length}/{item.index} {spec}@{budget:g}", refresh=False)
            if spec == FULL:
                result = reference
            elif key in together:
                result = together[key]
            else:
                controller = controller_of(spec, budget)
                try:
                    result = context.run(controller, budget, prompt, sample, forced)
                except ValueError as err:
                    raise ValueError(f"{where}, controller {spec} at budget {budget:g}: {err}") from None
            yield key, _record(dict(zip(KEY_FIELDS, key, strict=True)), sample, sample_seed_value, result, reference,
                               forced, context.protocol)
    finally:
        context.shared = None


@dataclass
class _SavedReference:
    """The part of a full-cache run a record needs from it, read back from the folder (``save_reference``)."""
    logits: list


def _keep(key: tuple, record: dict, done: dict, samples_path: Path, digests: dict) -> None:
    """Name the digest of the files the record's controller read, append the record and remember it."""
    if digests.get(key[0]) is not None:
        record["controller_digest"] = digests[key[0]]
    # opened per record (not once per run): a file replaced while a long run writes (a `git stash` or
    # checkout of the results folder) still receives every later record, instead of an unlinked copy
    append_record(samples_path, record)
    done[key] = record
