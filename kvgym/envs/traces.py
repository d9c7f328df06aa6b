"""Full-cache attention traces for the trace-replay environment (``PagedKVCacheReplayEnv``).

One trace = one full-cache pass of the runner over one prompt (chunked prefill, then greedy decode), recording
after every forward pass ``t`` (each prefill chunk, each decode step):

| key | shape / type | content |
|---|---|---|
| ``seen`` | ``[T]`` int64 | tokens seen after forward ``t`` |
| ``queries`` | ``[T]`` int64 | queries behind forward ``t``'s mass (the chunk's length in prefill, 1 in decode) |
| ``mass`` | ``[T, L, N]`` float16 | attention mass each block received in forward ``t`` (query-head averaged, summed over the forward's queries: each row sums to ``queries[t]``) |
| ``last_query`` | ``[T, L, heads, head_dim]`` float16 | the latest query (last position of the forward) per layer |
| ``mean_key`` | ``[L, N, kv_heads, head_dim]`` float16 | each block's mean post-RoPE key at the end of the run (a full cache never changes a block, so only the newest block's partial mean differs earlier) |
| ``num_tokens`` | ``[N]`` int64 | tokens per block at the end |
| ``sentence_end`` | ``[seen[-1]]`` bool | tokens that end a sentence (tokenizer punctuation, as ``cache.sentences``) |
| ``sentence_boundary`` | ``[N]`` bool | the block holds a sentence end |
| ``prompt_ids``, ``tokens`` | int64 | the prompt and the full cache's greedy continuation (``max_new_tokens`` of them; not stopped at EOS: the replay env stops where the live env would, at the tokenizer's ``eos_token_id``) |
| ``meta`` | dict | task, length, seed, index, model, ``prefill_chunk``, ``max_new_tokens``, ``eos_token_id``, shapes, ``bytes_per_token``, ``chat`` |

It is saved as one ``torch.save`` of a plain dict (tensors + a metadata dict; ``torch.load(weights_only=True)``
reads it). ``kvgym traces build`` writes ``<task>_<length>_<index>.pt`` files and ``index.json``.

The recording reuses ``cache.trace.TraceRecorder`` (one decision per forward pass, nothing
evicted) and extends it with the per-forward query count and latest query; it replays the live env's own
forward passes (``_env_forwards``: the env keeps kvgym's earlier streaming order, the first answer token from
the last prompt chunk, until it moves to the runner's protocols).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cache.controller import CacheView, Decision
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.trace import TraceRecorder

TRACE_FORMAT = "kvgym-trace"
TRACE_VERSION = 1


@dataclass
class Trace:
    """One recorded full-cache run; see the module docstring for the fields."""

    seen: torch.Tensor
    queries: torch.Tensor
    mass: torch.Tensor
    last_query: torch.Tensor
    mean_key: torch.Tensor
    num_tokens: torch.Tensor
    sentence_end: torch.Tensor
    sentence_boundary: torch.Tensor
    prompt_ids: torch.Tensor
    tokens: torch.Tensor
    meta: dict = field(default_factory=dict)

    TENSORS = ("seen", "queries", "mass", "last_query", "mean_key", "num_tokens", "sentence_end",
               "sentence_boundary", "prompt_ids", "tokens")

    @property
    def num_layers(self) -> int:
        return int(self.mass.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.mass.shape[2])

    @property
    def num_forwards(self) -> int:
        return int(self.seen.shape[0])

    @property
    def prefill_forwards(self) -> int:
        return math.ceil(int(self.meta["prompt_tokens"]) / int(self.meta["prefill_chunk"]))

    def to_dict(self) -> dict:
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": dict(self.meta),
                **{name: getattr(self, name) for name in self.TENSORS}}

    @classmethod
    def from_dict(cls, data: dict) -> Trace:
        if data.get("format") != TRACE_FORMAT:
            raise ValueError(f"not a kvgym trace (format {data.get('format')!r})")
        if data.get("version") != TRACE_VERSION:
            raise ValueError(f"trace version {data.get('version')} is not supported (this code reads {TRACE_VERSION})")
        return cls(**{name: data[name] for name in cls.TENSORS}, meta=dict(data["meta"]))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.to_dict(), tmp)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_dict(torch.load(Path(path), map_location="cpu", weights_only=True))


class _QueryTraceRecorder(TraceRecorder):
    """``TraceRecorder`` plus the forward's query count and latest query per layer."""

    def __init__(self):
        super().__init__()
        self.queries: list[int] = []
        self.last_queries: list[torch.Tensor] = []

    def decide(self, view: CacheView) -> list[Decision]:
        super().decide(view)
        self.queries.append(int(view.forward_queries))
        self.last_queries.append(view.last_query.to(torch.float16))
        return []


def prompt_ids_for(tokenizer, sample, chat: bool = False) -> list[int]:
    """The prompt token ids of ``sample`` exactly as ``PagedKVCacheEnv`` builds them (the one prompt builder)."""
    from eval.tasks.prompt import build_prompt

    return build_prompt(tokenizer, sample, chat).ids


_SENTENCE_IDS: dict[int, torch.Tensor] = {}


def _sentence_ends(tokenizer, ids: list[int]) -> torch.Tensor:
    """Bool per token: it ends a sentence (``cache.sentences`` rule; per-token decoding for tokenizers without
    a vocabulary, such as the tests' byte tokenizer)."""
    from cache.sentences import SENTENCE_END_CHARACTERS, is_sentence_end, sentence_end_token_ids

    if tokenizer is None:
        return torch.zeros(len(ids), dtype=torch.bool)
    if hasattr(tokenizer, "get_vocab"):
        key = id(tokenizer)
        if key not in _SENTENCE_IDS:
            _SENTENCE_IDS[key] = sentence_end_token_ids(tokenizer)
        return is_sentence_end(torch.tensor(ids, dtype=torch.int64), _SENTENCE_IDS[key])
    ends = []
    for token in ids:
        text = tokenizer.decode([token]).strip().rstrip("\"')”’")
        ends.append(text.endswith(SENTENCE_END_CHARACTERS) and not text.endswith(".."))
    return torch.tensor(ends, dtype=torch.bool)


@torch.no_grad()
def build_trace(model, tokenizer, sample_or_prompt_ids, prefill_chunk: int = 64, decide_every: int = 1,
                max_new_tokens: int | None = None, chat: bool = False, meta: dict | None = None) -> Trace:
    """Record the full cache's trace of a task ``Sample`` (prompt built as the live env does, ``chat`` or not)
    or of a list of prompt ids: prefill in ``prefill_chunk`` chunks, then ``max_new_tokens`` greedy tokens
    (default: the sample's; 32 for raw ids).

    ``decide_every`` must be 1: the trace records every forward pass, which serves any ``decide_every`` at
    replay time (a coarser trace could not, since over-budget decision points fall on any decode step).
    """
    from eval.tasks.base import Sample

    if decide_every != 1:
        raise ValueError("build_trace: decide_every must be 1 (the trace records every forward pass; the replay env "
                         "groups them for any decide_every)")
    meta = dict(meta or {})
    if isinstance(sample_or_prompt_ids, Sample):
        sample = sample_or_prompt_ids
        prompt = prompt_ids_for(tokenizer, sample, chat)
        new_tokens = max_new_tokens or sample.max_new_tokens
        meta.update(task=sample.task, length=sample.length, seed=sample.seed, index=sample.index,
                    metric=sample.metric, outputs=list(sample.outputs))
    else:
        prompt = [int(i) for i in (sample_or_prompt_ids.tolist() if hasattr(sample_or_prompt_ids, "tolist")
                                   else sample_or_prompt_ids)]
        new_tokens = max_new_tokens or 32
    if not prompt:
        raise ValueError("build_trace: the prompt is empty")
    if new_tokens < 1:
        raise ValueError(f"build_trace: max_new_tokens must be >= 1, got {new_tokens}")
    config = CacheConfig(stats_window=max(64, prefill_chunk), max_tokens=len(prompt) + new_tokens)
    recorder = _QueryTraceRecorder()
    cache, generated = _env_forwards(model, config, recorder, prompt, prefill_chunk, new_tokens)
    try:
        attention = recorder.trace(generated)
        cache.refresh_key_stats()
        n = cache.num_logical_blocks()
        num_tokens = cache.tables.num_tokens[0, :n].to(torch.int64).clone()
        mean_key = cache.stats.mean_key(cache.tables.num_tokens)[:, :n].to(torch.float16).clone()
        bytes_per_token = int(cache.bytes_per_token)
    finally:
        cache.close()
    tokens = [int(t) for t in generated]
    fed = prompt + tokens[:-1]  # the last generated token is never fed back
    sentence_end = _sentence_ends(tokenizer, fed)
    block_size = config.block_size
    padded = torch.zeros(n * block_size, dtype=torch.bool)
    padded[: len(fed)] = sentence_end[: n * block_size]
    mass = torch.zeros(attention.mass.shape[0], attention.mass.shape[1], n)
    width = min(n, attention.mass.shape[2])
    mass[:, :, :width] = attention.mass[:, :, :width]
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    meta.update(
        format_note="see kvgym/envs/traces.py", model=meta.get("model", getattr(cfg, "_name_or_path", "") or ""),
        prefill_chunk=int(prefill_chunk), max_new_tokens=int(new_tokens), prompt_tokens=len(prompt),
        eos_token_id=getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None,
        num_layers=int(cfg.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        block_size=block_size, bytes_per_token=bytes_per_token, chat=bool(chat),
    )
    return Trace(
        seen=attention.seen.clone(), queries=torch.tensor(recorder.queries, dtype=torch.int64),
        mass=mass.to(torch.float16), last_query=torch.stack(recorder.last_queries),
        mean_key=mean_key, num_tokens=num_tokens, sentence_end=sentence_end,
        sentence_boundary=padded.view(n, block_size).any(dim=1),
        prompt_ids=torch.tensor(prompt, dtype=torch.int64), tokens=torch.tensor(tokens, dtype=torch.int64),
        meta=meta,
    )


def _env_forwards(model, config: CacheConfig, recorder, prompt: list[int], prefill_chunk: int, new_tokens: int):
    """The live env's forward passes over the full cache (prompt chunks from its start, the first token from the
    last chunk's logits, then one token a step; ``PagedKVCacheEnv.forwards``), the recorder deciding after each.
    Returns the cache and the greedy tokens."""
    cache = PagedKVCache(model.config, config)
    full = [cache.max_blocks] * cache.num_layers
    logits = None
    for start in range(0, len(prompt), prefill_chunk):
        logits = model(input_ids=torch.tensor([prompt[start : start + prefill_chunk]]), cache=cache, use_cache=True,
                       logits_to_keep=1).logits
        recorder.decide(CacheView.from_cache(cache, full))
    generated = [int(logits[0, -1].argmax())]
    while len(generated) < new_tokens:
        logits = model(input_ids=torch.tensor([generated[-1:]]), cache=cache, use_cache=True).logits
        recorder.decide(CacheView.from_cache(cache, full))
        generated.append(int(logits[0, -1].argmax()))
    return cache, generated


def trace_filename(task: str, length: int, index: int) -> str:
    """The file name of one sample's trace."""
    return f"{task}_{length}_{index}.pt"


def build_traces(model, tokenizer, tasks: list[str], lengths: list[int], n: int, seed: int, out: str | Path,
                 prefill_chunk: int = 64, max_new_tokens: int | None = None, chat: bool = False,
                 model_name: str | None = None, progress: bool = True) -> list[dict]:
    """Write ``out/<task>_<length>_<index>.pt`` for every task × length × index < ``n`` (samples from
    ``get_task(task)(tokenizer, length, seed, index)``) and ``out/index.json``; existing traces are kept
    (reruns resume). Returns the index entries."""
    from eval.tasks.base import get_task

    if n < 1:
        raise ValueError(f"--n {n}: need at least one sample per task and length")
    generators = {task: get_task(task) for task in tasks}  # unknown tasks fail before any work
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(task, length, index) for task in tasks for length in lengths for index in range(n)]
    try:
        from tqdm.auto import tqdm

        bar = tqdm(jobs, desc="traces", unit="trace", disable=not progress or None)
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        bar = jobs
    entries = []
    for task, length, index in bar:
        path = out / trace_filename(task, length, index)
        trace = None
        if path.is_file():
            try:
                trace = Trace.load(path)
                if int(trace.meta.get("prefill_chunk", -1)) != prefill_chunk:
                    trace = None
            except Exception:  # a broken or foreign file is rebuilt
                trace = None
        if trace is None:
            sample = generators[task](tokenizer, length, seed, index)
            trace = build_trace(model, tokenizer, sample, prefill_chunk=prefill_chunk, max_new_tokens=max_new_tokens,
                                chat=chat, meta={"model": model_name or ""})
            trace.save(path)
        entries.append({"file": path.name, "task": task, "length": length, "index": index, "seed": seed,
                        "prompt_tokens": int(trace.meta["prompt_tokens"]),
                        "max_new_tokens": int(trace.meta["max_new_tokens"]), "forwards": trace.num_forwards})
    index_data = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": model_name, "prefill_chunk": prefill_chunk,
                  "chat": chat, "seed": seed, "traces": entries}
    (out / "index.json").write_text(json.dumps(index_data, indent=2))
    return entries


def trace_paths(source: str | Path) -> list[Path]:
    """The trace files of a folder (in ``index.json`` order when there is one, else sorted ``*.pt``)."""
    folder = Path(source)
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        raise FileNotFoundError(f"trace folder {folder} does not exist (build one with `kvgym traces build`)")
    index = folder / "index.json"
    if index.is_file():
        paths = [folder / entry["file"] for entry in json.loads(index.read_text())["traces"]]
    else:
        paths = sorted(folder.glob("*.pt"))
    if not paths:
        raise FileNotFoundError(f"no traces in {folder} (build them with `kvgym traces build`)")
    return paths
