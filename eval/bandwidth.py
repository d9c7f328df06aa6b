"""The seed's instrumented run: attention bytes read per call against context length, full cache vs a budget.

A prose corpus is streamed through the model with a ``PagedKVCache`` in forward steps of ``chunk`` tokens
(teacher forcing, no sampling), twice: once with the full cache, once with a device budget enforced after
every step by ``EvictOldest`` (and the cache's fallback rule, as the runner does). With the full cache
every call reads the whole context, so bytes per call grow linearly with it; under a budget they stop
growing once the budget is reached.

Outputs in ``out_dir``:

- ``bandwidth.csv``: one row per step and run (``full`` | ``budgeted``): ``context_tokens`` (tokens seen
  after the step), ``resident_tokens`` (layer 0's device tokens during the step's forward, i.e. what it
  attended, before that step's evictions), ``bytes_read_per_call`` (mean over layers of the step's
  ``last_bytes_read``), ``bytes_moved`` (cumulative over all tier pairs, after the step's evictions), then
  ``resident_after_budget`` (layer 0, after the step's evictions) and ``operations`` (cumulative);
- ``bandwidth.png``: bytes per call vs context, both runs, with the full run's linear fit and its R²;
- ``evictions.jsonl``: the budgeted run's ``operation_log``, one JSON object a line, with ``"run"``;
- ``summary.json``: the fit (``r2``, ``slope_bytes_per_token``), ``flat_ratio`` (max / min bytes per call
  over the last half of the budgeted steps), the budget, wall times.
"""

from __future__ import annotations

import csv
import json
import time
from importlib import resources
from pathlib import Path

import torch

from cache.controller import CacheView, EvictOldest, apply_decisions
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.runner import budget_blocks

DEFAULT_CORPUS = "alice29.txt"
CSV_COLUMNS = ("run", "step", "context_tokens", "resident_tokens", "bytes_read_per_call", "bytes_moved",
               "resident_after_budget", "operations")


def default_corpus_path() -> Path:
    """The packaged public-domain prose (Alice's Adventures in Wonderland)."""
    return Path(str(resources.files("eval").joinpath("data", DEFAULT_CORPUS)))


def corpus_token_ids(corpus: str | Path | None = None, tokenizer=None) -> list[int]:
    """The token ids of a corpus file: a ``.json`` file holding a list of token ids is used as is; any other
    file is read as text and tokenized with ``tokenizer``. ``None`` is the packaged prose."""
    path = Path(corpus).expanduser() if corpus is not None else default_corpus_path()
    if not path.is_file():
        raise ValueError(f"corpus {str(path)!r} does not exist or is not a file: give a UTF-8 text file "
                         "(or a .json list of token ids), or omit --corpus to use the packaged alice29.txt")
    if path.suffix == ".json":
        try:
            ids = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"corpus {str(path)!r}: a .json corpus must be a list of token ids ({err})") from None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"corpus {str(path)!r}: a .json corpus must be a list of integer token ids")
        return ids
    if tokenizer is None:
        raise ValueError(f"corpus {str(path)!r} is text and needs a tokenizer; pass one, or give token ids "
                         "(a .json list) instead")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"corpus {str(path)!r} is not UTF-8 text ({err})") from None
    return list(tokenizer(text, verbose=False).input_ids)


def _check_inputs(model, ids: list[int], max_tokens: int, chunk: int, source: str) -> None:
    positions = int(model.config.max_position_embeddings)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: tokens per forward step must be an integer >= 1, got {chunk!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if max_tokens > positions:
        raise ValueError(f"max_tokens {max_tokens} exceeds the model's {positions} positions; "
                         f"use at most {positions}")
    if max_tokens > len(ids):
        raise ValueError(f"max_tokens {max_tokens} exceeds the corpus ({source}: {len(ids)} tokens); "
                         f"use at most {len(ids)} or a longer corpus")
    vocab = getattr(model.config, "vocab_size", None)
    head = ids[:max_tokens]
    if vocab is not None and head and (min(head) < 0 or max(head) >= vocab):
        raise ValueError(f"corpus ({source}): token ids must be in 0..{vocab - 1} for this model, "
                         f"got ids in {min(head)}..{max(head)}")


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step")  # TQDM_DISABLE=1 turns it off


@torch.no_grad()
def stream(model, ids: torch.Tensor, max_tokens: int, chunk: int, budget: list[int] | None, run: str,
           host_blocks: int = 0, progress: bool = True) -> tuple[list[dict], PagedKVCache, dict]:
    """Feed ``ids`` ``[1, T]`` through ``model`` in steps of ``chunk`` tokens with a fresh ``PagedKVCache``;
    with ``budget`` (blocks per layer) ``EvictOldest`` and the cache's fallback rule act after every step.
    Returns the per-step rows, the cache, and run totals."""
    # capacity in whole blocks: per-token buffers of the cache then cover every logical block's slots
    block_size = CacheConfig.block_size
    capacity = -(-max_tokens // block_size) * block_size
    cache = PagedKVCache(model.config, CacheConfig(max_tokens=capacity, host_blocks=host_blocks))
    controller = EvictOldest() if budget is not None else None
    device = next(model.parameters()).device
    ids = ids.to(device)
    total_steps = -(-ids.shape[1] // chunk)
    rows, operations, fallbacks = [], 0, 0
    bar = _progress(total_steps, f"{run} run") if progress else None
    start = time.perf_counter()
    for step, first in enumerate(range(0, ids.shape[1], chunk)):
        model(input_ids=ids[:, first : first + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        bytes_read = sum(cache.last_bytes_read) / cache.num_layers
        resident = cache.resident_tokens(0)
        if controller is not None:
            view = CacheView.from_cache(cache, budget)
            operations += sum(apply_decisions(cache, controller.decide(view)).values())
            fallbacks += cache.enforce_budget(budget, "lowest_mass")
        rows.append({"run": run, "step": step, "context_tokens": cache.seen, "resident_tokens": resident,
                     "bytes_read_per_call": bytes_read, "bytes_moved": sum(cache.bytes_moved.values()),
                     "resident_after_budget": cache.resident_tokens(0), "operations": len(cache.operation_log)})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(context=cache.seen, resident=resident)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - start
    if bar is not None:
        bar.close()
    totals = {"wall_s": round(wall_s, 3), "steps": len(rows), "controller_operations": operations,
              "fallbacks": fallbacks,
              "bytes_moved": {f"{a}->{b}": n for (a, b), n in cache.bytes_moved.items()},
              "blocks_per_tier_layer0": {tier: counts[0] for tier, counts in cache.blocks_per_tier().items()}}
    return rows, cache, totals


def linear_fit(x: list[float], y: list[float]) -> tuple[float, float, float | None]:
    """Least-squares ``y = slope * x + intercept``; returns ``(slope, intercept, r2)`` (``r2`` is ``None``
    when ``y`` is constant or there are fewer than two points)."""
    import numpy as np

    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.size < 2 or np.ptp(xs) == 0:
        return 0.0, float(ys.mean()) if ys.size else 0.0, None
    slope, intercept = np.polyfit(xs, ys, 1)
    total = float(((ys - ys.mean()) ** 2).sum())
    residual = float(((ys - (slope * xs + intercept)) ** 2).sum())
    return float(slope), float(intercept), (1.0 - residual / total) if total > 0 else None


def flat_ratio(values: list[float]) -> float | None:
    """``max / min`` of the last half of ``values`` (1.0 = perfectly flat)."""
    tail = values[len(values) // 2 :]
    if not tail or min(tail) <= 0:
        return None
    return max(tail) / min(tail)


def plot(full: list[dict], budgeted: list[dict], fit: tuple[float, float, float | None], path: Path,
         title: str) -> None:
    """Plot bytes read per token against context, the full cache beside the budgeted runs, with the fit."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    kib = 1024.0
    x_full = [r["context_tokens"] for r in full]
    axes.plot(x_full, [r["bytes_read_per_call"] / kib for r in full], "o", markersize=3, color="tab:blue",
              label="full cache")
    axes.plot([r["context_tokens"] for r in budgeted], [r["bytes_read_per_call"] / kib for r in budgeted],
              "s", markersize=3, color="tab:orange", label="budgeted (EvictOldest)")
    slope, intercept, r2 = fit
    if x_full:
        ends = [min(x_full), max(x_full)]
        r2_text = "n/a" if r2 is None else f"{r2:.6f}"
        shown = 0.0 if abs(intercept) < 0.5 else intercept  # no "-0 B" from a float residue
        axes.plot(ends, [(slope * x + intercept) / kib for x in ends], "--", color="tab:blue", linewidth=1,
                  label=f"full fit: {slope:,.1f} B/token × context {shown:+,.0f} B, R² = {r2_text}")
    axes.set_xlabel("context length (tokens seen)")
    axes.set_ylabel("bytes read per attention call (KiB, mean over layers)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)


def run_bandwidth(model, tokenizer=None, *, out_dir: str | Path, max_tokens: int, budget: float | int | list[int],
                  chunk: int = 64, corpus: str | Path | None = None, token_ids=None, host_blocks: int = 0,
                  model_name: str | None = None, progress: bool = True) -> dict:
    """Run the full and the budgeted pass and write the four files into ``out_dir``; returns the summary.

    The tokens come from ``token_ids`` (a sequence or tensor of ids) when given, else from ``corpus`` (a
    text file tokenized with ``tokenizer``, or a ``.json`` list of ids; default the packaged prose); the
    first ``max_tokens`` are used. ``budget`` is a fraction of ``max_tokens`` or blocks per layer (see
    ``cache.runner.budget_blocks``).
    """
    if budget is None:
        raise ValueError("budget: the bandwidth run compares the full cache with a budgeted one; give a "
                         "fraction of max_tokens like 0.25 or a block count per layer like 64")
    if token_ids is not None:
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().tolist()
        source = "token_ids"
    else:
        ids = corpus_token_ids(corpus, tokenizer)
        source = str(corpus) if corpus is not None else DEFAULT_CORPUS
    _check_inputs(model, ids, max_tokens, chunk, source)
    if host_blocks < 0:
        raise ValueError(f"host_blocks must be >= 0, got {host_blocks}")
    config = CacheConfig()
    blocks = budget_blocks(budget, max_tokens, config.block_size, model.config.num_hidden_layers,
                           config.sink_blocks + 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stream_ids = torch.tensor(ids[:max_tokens], dtype=torch.long).reshape(1, -1)

    full_rows, full_cache, full_totals = stream(model, stream_ids, max_tokens, chunk, None, "full",
                                                host_blocks, progress)
    del full_cache
    budget_rows, cache, budget_totals = stream(model, stream_ids, max_tokens, chunk, blocks, "budgeted",
                                               host_blocks, progress)

    with open(out / "bandwidth.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(full_rows + budget_rows)
    with open(out / "evictions.jsonl", "w") as f:
        for entry in cache.operation_log:
            f.write(json.dumps({"run": "budgeted", **entry}) + "\n")

    fit = linear_fit([r["context_tokens"] for r in full_rows], [r["bytes_read_per_call"] for r in full_rows])
    ratio = flat_ratio([r["bytes_read_per_call"] for r in budget_rows])
    name = model_name or getattr(model.config, "_name_or_path", None) or type(model).__name__
    summary = {
        "full": {"r2": fit[2], "slope_bytes_per_token": fit[0], "intercept_bytes": fit[1],
                 "final_bytes_read_per_call": full_rows[-1]["bytes_read_per_call"], **full_totals},
        "budgeted": {"flat_ratio": ratio, "budget_blocks_per_layer": blocks[0],
                     "budget_tokens_per_layer": blocks[0] * config.block_size,
                     "max_resident_tokens": max(r["resident_tokens"] for r in budget_rows),
                     "final_bytes_read_per_call": budget_rows[-1]["bytes_read_per_call"],
                     "operations": len(cache.operation_log), **budget_totals},
        "model": name, "max_tokens": max_tokens, "chunk": chunk, "budget": budget, "host_blocks": host_blocks,
        "corpus": source, "bytes_per_token_per_layer": cache.bytes_per_token,
        "num_layers": cache.num_layers, "block_size": config.block_size,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = f"{name}: {max_tokens} tokens, chunk {chunk}, budget {blocks[0]} blocks/layer"
    plot(full_rows, budget_rows, fit, out / "bandwidth.png", title)
    return summary


def check_bandwidth_args(chunk: int, corpus: Path | None) -> None:
    """``kvgym bench bandwidth``'s inputs, checked before a model loads: the chunk size and the corpus file."""
    if chunk < 1:
        raise ValueError(f"--chunk {chunk}: tokens per forward step must be >= 1")
    corpus = corpus if corpus is not None else default_corpus_path()
    if not corpus.expanduser().is_file():
        corpus_token_ids(corpus)  # raises the clear error


def describe_bandwidth(summary: dict, out: Path) -> str:
    """Two lines on ``run_bandwidth``'s ``summary``: the full cache's slope and fit, the budgeted run's flatness."""
    full, budgeted = summary["full"], summary["budgeted"]
    return (f"full: R² {full['r2']}, slope {full['slope_bytes_per_token']:.1f} B/token, {full['wall_s']} s; "
            f"budgeted ({budgeted['budget_blocks_per_layer']} blocks/layer): flat ratio {budgeted['flat_ratio']}, "
            f"{budgeted['operations']} operations, {budgeted['wall_s']} s\n"
            f"wrote {out}/bandwidth.csv, bandwidth.png, evictions.jsonl, summary.json")
