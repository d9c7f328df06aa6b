"""The ``kvgym`` command line: it parses, checks what can be checked before a model loads, and calls the module that
does the work (``kvgym --help`` lists the commands). The only place that imports every part of the project."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvgym.arguments import (
    BUNDLED_PROMPT,
    PROTOCOL_CHOICES,
    add_model_args,
    bundled_prompt,
    parse_budget,
    parse_int_list,
)
from kvgym.reports import write_json


def build_parser() -> argparse.ArgumentParser:
    """The command line: every command and its flags."""
    parser = argparse.ArgumentParser(prog="kvgym", description="KV-cache policies on a live, paged KV cache.")
    commands = parser.add_subparsers(dest="command", required=True)

    setup = commands.add_parser("setup", help="fetch and convert the default model (SmolLM2-135M-Instruct); fetch the essays and code haystacks")
    setup.add_argument("--rebuild", action="store_true", help="convert again even if a valid copy exists")

    generate = commands.add_parser("generate", help="run a prompt through the paged cache")
    add_model_args(generate)
    source = generate.add_mutually_exclusive_group()
    source.add_argument("--prompt-file", type=Path, help=f"text file with the prompt (default: bundled {BUNDLED_PROMPT})")
    source.add_argument("--prompt", help="the prompt text itself")
    generate.add_argument("--budget", type=parse_budget, default=None,
                          help="device budget: fraction of the prompt's tokens (0.25), blocks per layer (64), or 'full'")
    generate.add_argument("--protocol", default="streaming", choices=("streaming", "oneshot"),
                          help="streaming: chunked prefill with decisions, bounded memory; oneshot: dense prefill, "
                               "one decision, then the cache grows while decoding")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--block-size", type=int, default=16)
    generate.add_argument("--controller", default=None,
                          help="cache policy by name with optional parameters, e.g. h2o or streamingllm:n_sink=32 "
                               "(default: evict the oldest unpinned blocks when a budget is set)")
    generate.add_argument("--host-blocks", type=int, default=0, help="host-tier blocks per layer (0: evicted blocks are dropped)")
    generate.add_argument("--disk-blocks", type=int, default=0, help="disk-tier blocks per layer (memory-mapped files)")
    generate.add_argument("--prefill-chunk", type=int, default=64)
    generate.add_argument("--decide-every", type=int, default=8, help="decode steps between controller decisions")
    generate.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    generate.add_argument("--json", type=Path, help="also write the run's summary as JSON here")

    bench = commands.add_parser("bench", help="benchmarks (write JSON)")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    bench_cache = bench_kinds.add_parser("cache", help="decode ms/token and prefill time: paged vs DynamicCache")
    add_model_args(bench_cache)
    bench_cache.add_argument("--contexts", type=parse_int_list, default=[512, 2048, 4096])
    bench_cache.add_argument("--decode-steps", type=int, default=32)
    bench_cache.add_argument("--prefill-repeats", type=int, default=3)
    bench_cache.add_argument("--json", type=Path, required=True, help="where to write the results")

    bench_ranker = bench_kinds.add_parser(
        "policy", help="ranking policy: ms per decision scoring every block (<= 1 ms), replay env steps/s (>= 2000)")
    bench_ranker.add_argument("--model", default="smollm2-135m", help="the model whose cache is scored")
    bench_ranker.add_argument("--policy", type=Path, default=Path("policies/ranker_smollm2.pt"))
    bench_ranker.add_argument("--context", type=int, default=2048)
    bench_ranker.add_argument("--repeats", type=int, default=50)
    bench_ranker.add_argument("--decisions", type=Path, default=None,
                              help="a `python -m benchmarks.ranker_tools collect` folder: also time the replay env over all of it")
    bench_ranker.add_argument("--replay-steps", type=int, default=20000)
    bench_ranker.add_argument("--json", type=Path, required=True, help="where to write the results")

    bandwidth = bench_kinds.add_parser("bandwidth", help="attention bytes per call vs context: full cache vs a budget")
    add_model_args(bandwidth)
    bandwidth.add_argument("--max-tokens", type=int, default=8192, help="tokens of the corpus to stream (its first N)")
    bandwidth.add_argument("--budget", type=parse_budget, default=0.25,
                           help="device budget of the budgeted run: fraction of --max-tokens (0.25) or blocks per layer (64)")
    bandwidth.add_argument("--chunk", type=int, default=64, help="tokens per forward step")
    bandwidth.add_argument("--corpus", type=Path, default=None,
                           help="UTF-8 text file, or a .json list of token ids (default: packaged eval/data/alice29.txt)")
    bandwidth.add_argument("--host-blocks", type=int, default=0, help="host-tier blocks per layer (0: evicted blocks are dropped)")
    bandwidth.add_argument("--out", type=Path, required=True, help="folder for bandwidth.csv/.png, evictions.jsonl, summary.json")
    bench_eval = bench_kinds.add_parser("eval", help="evaluation runs per hour: per-run, shared prefills, batched runs")
    add_model_args(bench_eval)
    bench_eval.add_argument("--controllers", default="h2o,tova,snapkv,streamingllm,lru")
    bench_eval.add_argument("--budgets", default="0.125,0.25,0.5")
    bench_eval.add_argument("--tasks", default="passkey")
    bench_eval.add_argument("--lengths", default="1024")
    bench_eval.add_argument("--n", type=int, default=2)
    bench_eval.add_argument("--protocol", default="oneshot-question", choices=PROTOCOL_CHOICES)
    bench_eval.add_argument("--json", type=Path, required=True, help="where to write the results")
    bench_ops = bench_kinds.add_parser("ops", help="time per operation, CacheView cost, budgeted vs full decode")
    add_model_args(bench_ops)
    bench_ops.add_argument("--contexts", type=parse_int_list, default=[4096, 8192])
    bench_ops.add_argument("--budget", type=float, default=0.25)
    bench_ops.add_argument("--decode-steps", type=int, default=32,
                           help="per run; 32 covers two block boundaries (two evictions / merges per layer)")
    bench_ops.add_argument("--json", type=Path, required=True, help="where to write the results")

    bench_roofline = bench_kinds.add_parser(
        "roofline", help="memory bandwidth, per-token byte floor, decode time as a fraction of it (full / budgeted)")
    add_model_args(bench_roofline)
    bench_roofline.add_argument("--contexts", type=parse_int_list, default=[512, 2048, 4096, 8192])
    bench_roofline.add_argument("--budget", type=float, default=0.25)
    bench_roofline.add_argument("--decode-steps", type=int, default=16)
    bench_roofline.add_argument("--bandwidth-mb", type=int, default=512, help="buffer size of the bandwidth test")
    bench_roofline.add_argument("--json", type=Path, required=True, help="where to write the results")

    evaluation = commands.add_parser(
        "eval", help="accuracy, KL and bytes of controllers × budgets on the task suite, against the full cache")
    add_model_args(evaluation)
    evaluation.add_argument("--controllers", default="lru,sentencekv,spindlekv,h2o,full",
                            help="comma-separated controller specs (parameters stay with their spec: "
                                 "lru,h2o:heavy_ratio=0.25,recent_ratio=0.25); the full cache always runs as the reference")
    evaluation.add_argument("--budgets", default="0.125,0.25,0.5",
                            help="comma-separated device budgets, fractions in (0, 1] of each sample's context")
    evaluation.add_argument("--protocol", default="streaming", choices=PROTOCOL_CHOICES,
                            help="streaming (chunked prefill, decisions throughout, bounded memory), oneshot (kvpress: "
                                 "the context prefilled densely, one decision, the cache grows), oneshot-question (the "
                                 "question inside the dense prefill), multiturn (streamed, one budget across turns)")
    evaluation.add_argument("--decode-budget", default="grow", choices=("grow", "fixed"),
                            help="one-shot protocols: the cache grows after the decision (kvpress), or keeps the budget")
    evaluation.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                            help="send each sample's runs to a Ray cluster (ADDRESS, e.g. auto or ray://host:10001; "
                                 "none: a local Ray, one worker per CPU); records and resume as in a local run")
    evaluation.add_argument("--ray-workers", type=int, default=None, help="with --ray: model workers (default: 1 per CPU)")
    evaluation.add_argument("--budget-scope", default=None, choices=("layer", "global"),
                            help="layer: each layer holds its share; global (kvpress's layerwise=False): only the total "
                                 "holds, score-based baselines evict their lowest scores over all layers (default: the "
                                 "controller's own: global for kvzip unless kvzip:layerwise=true, layer otherwise)")
    evaluation.add_argument("--dataset", default=None,
                            help="samples through `datasets`: a local JSONL/Parquet file or folder, or a hub id "
                                 "(kvpress schema: context, question, answers; SCBench: context, multi_turns)")
    evaluation.add_argument("--dataset-split", default=None, help="the split of --dataset (when it has several)")
    evaluation.add_argument("--block-size", type=int, default=16, help="tokens per cache block (1: token level)")
    evaluation.add_argument("--tasks", default=None,
                            help="comma-separated task names (default: passkey,niah_single,vt,research,text; "
                                 "with --tasks-file and no --tasks: only the file)")
    evaluation.add_argument("--family-split", choices=("train", "validation", "heldout", "heldout_hard"), default=None,
                            help="add the retrieval families of this side of the generalization split "
                                 "(eval.tasks.families: heldout = wordings and fillers no policy trained on; "
                                 "the same as adding the task families_heldout)")
    evaluation.add_argument("--lengths", default="2048,4096", help="comma-separated target prompt lengths in tokens")
    evaluation.add_argument("--n", type=int, default=20, help="samples per task and length")
    evaluation.add_argument("--seed", type=int, default=0, help="draws the samples (another seed: fresh samples)")
    evaluation.add_argument("--tasks-file", type=Path, default=None, help="JSONL of your own samples: input (or "
                            "context + question), answer_prefix, outputs, metric per line")
    evaluation.add_argument("--host-blocks", type=int, default=512,
                            help="host-tier blocks per layer (default 512 = 8k tokens: evicted blocks stay "
                                 "fetchable, which retrieval policies such as sentencekv and quest need; "
                                 "0: evicted blocks are dropped)")
    evaluation.add_argument("--prefill-chunk", type=int, default=64)
    evaluation.add_argument("--decide-every", type=int, default=8, help="decode steps between controller decisions")
    evaluation.add_argument("--batch-runs", action="store_true", help="run each sample's controllers and budgets in "
                            "lockstep, their forwards batched (same answers up to float rounding; times are shared)")
    evaluation.add_argument("--no-chat", action="store_true", help="do not wrap the prompts in the chat template")
    evaluation.add_argument("--no-plots", action="store_true", help="write the tables only")
    evaluation.add_argument("--out", type=Path, required=True,
                            help="folder for samples.jsonl, summary.csv/.md and the plots (reruns resume)")

    train = commands.add_parser(
        "train", help="train the ranking policy from a config: collect decision points, imitation, policy gradient, "
                      "PPO (agents.ranker.pipeline)")
    train.add_argument("--config", default="ranker_smollm2",
                       help="a YAML file, or a name under configs/train (ranker_smollm2)")
    train.add_argument("--resume", action="store_true", help="continue runs/<name>/ where it stopped")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. train.warm_epochs=10 name=try2 data_dir=data/generalization")

    peer = commands.add_parser("peer", help="kvgym's eval results beside kvpress's on the same samples (Markdown)")
    peer.add_argument("--samples", type=Path, required=True, help="a samples.jsonl written by kvgym eval")
    peer.add_argument("--peer", type=Path, required=True,
                      help="kvpress's per-press results (e.g. ../shared/peer/kvpress_2k_results.jsonl)")
    peer.add_argument("--pair", action="append", default=[], metavar="SPEC=PRESS",
                      help="pair a kvgym controller spec (or name) with a kvpress press other than its namesake, "
                           "e.g. kvzip=kvzip_layerwise_shared (repeatable)")
    compare = commands.add_parser(
        "compare", help="one controller against every other on the same samples: paired differences, bootstrap CIs")
    compare.add_argument("--samples", type=Path, required=True, help="a samples.jsonl written by kvgym eval")
    compare.add_argument("--controller", required=True, help="its name as in the results, e.g. ranker:policies/x.pt")
    compare.add_argument("--json", type=Path, default=None, help="also write the rows here")
    report = commands.add_parser(
        "report", help="rewrite a results folder's summary (md, csv, plots) from every record in its samples.jsonl")
    report.add_argument("folders", type=Path, nargs="+", metavar="FOLDER",
                        help="a folder written by kvgym eval (possibly by several runs); several with --leaderboard")
    report.add_argument("--leaderboard", type=Path, default=None, metavar="OUT",
                        help="rank the methods of all FOLDERs: accuracy vs compression per setting (protocol, prompt "
                             "form, host tier), one plot and one ranked table each, in OUT/leaderboard.{md,json,png}")
    report.add_argument("--min-full", type=float, default=0.8,
                        help="with --leaderboard: cells count only where the full cache scores at least this")
    report.add_argument("--no-plots", action="store_true")
    board = commands.add_parser("tensorboard", help="start TensorBoard on the training runs (offline)")
    board.add_argument("--logdir", type=Path, default=Path("runs"))
    board.add_argument("--port", type=int, default=6006)
    return parser


DEFAULT_EVAL_TASKS = "passkey,niah_single,vt,research,text"


def cmd_eval(args) -> int:
    """``kvgym eval``: check the inputs before loading the model, then run the grid (``eval.harness``)."""
    from cache import models
    from eval.harness import evaluate
    from eval.inputs import check_eval_args

    tasks, ray = check_eval_args(args, DEFAULT_EVAL_TASKS)
    loaded = models.load_model(args.model, device=args.device, dtype=args.dtype)
    rows = evaluate(loaded.model, loaded.tokenizer, args.controllers, args.budgets, tasks, args.lengths, args.n,
                    args.seed, args.out, tasks_file=args.tasks_file, dataset=args.dataset,
                    dataset_split=args.dataset_split, chat=not args.no_chat, host_blocks=args.host_blocks,
                    block_size=args.block_size, prefill_chunk=args.prefill_chunk, decide_every=args.decide_every,
                    protocol=args.protocol, decode_budget=args.decode_budget, budget_scope=args.budget_scope,
                    model_name=args.model, plots=not args.no_plots, ray=ray, batch_runs=args.batch_runs)
    failed = sorted({(r["task"], r["length"]) for r in rows if r["full_cache_failed"]})
    print((args.out / "summary.md").read_text())
    if failed:
        print("the full cache scores 0 on: " + ", ".join(f"{t} @ {n}" for t, n in failed), file=sys.stderr)
    print(f"wrote {args.out}/samples.jsonl, summary.csv, summary.md"
          + ("" if args.no_plots else ", accuracy_vs_budget.png, bytes_vs_context.png"))
    return 0


def cmd_setup(args) -> int:
    """``kvgym setup``: convert the default model and fetch the corpora."""
    from cache.models import ensure_smollm2
    from eval.tasks.corpora import ensure_corpora

    path = ensure_smollm2(rebuild=args.rebuild)
    print(f"default model ready: {path}")
    print(f"haystack corpora ready: {ensure_corpora()}")
    return 0


def cmd_generate(args) -> int:
    """``kvgym generate``: ``kvgym.generate``."""
    from kvgym.generate import generate

    generate(args)
    return 0


def cmd_bench(args) -> int:
    """``kvgym bench``: the benchmark scripts behind BENCHMARKS.md."""
    from cache.benchmark import bench_cache, bench_ops, bench_roofline
    from cache.models import load_model

    if args.bench == "bandwidth":
        return cmd_bandwidth(args)
    if args.bench == "policy":
        from agents.ranker.benchmark import bench_decision, bench_replay

        report = {"model": args.model, "decision": bench_decision(load_model(args.model).model, args.policy,
                                                                  args.context, repeats=args.repeats)}
        if args.decisions is not None:
            report["replay_env"] = bench_replay(args.decisions, args.replay_steps)
        write_json(report, args.json)
        print(json.dumps(report, indent=1))
        return 0
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    model, tokenizer, prompt = loaded.model, loaded.tokenizer, bundled_prompt()
    progress = lambda row: print(json.dumps(row), flush=True)  # noqa: E731
    if args.bench == "eval":
        from eval.benchmark import bench_eval

        report = bench_eval(model, tokenizer, args.controllers, args.budgets, args.tasks, args.lengths, args.n,
                            args.protocol, model_name=args.model, progress=progress)
    elif args.bench == "ops":
        report = bench_ops(model, tokenizer, prompt, args.contexts, budget=args.budget, decode_steps=args.decode_steps,
                           progress=progress)
    elif args.bench == "roofline":
        report = bench_roofline(model, tokenizer, prompt, args.contexts, budget=args.budget,
                                decode_steps=args.decode_steps, bandwidth_mb=args.bandwidth_mb, progress=progress)
    else:
        report = bench_cache(model, tokenizer, prompt, args.contexts, decode_steps=args.decode_steps,
                             prefill_repeats=args.prefill_repeats, progress=progress)
    write_json({**report, "model": args.model, "device": args.device}, args.json)
    return 0


def cmd_bandwidth(args) -> int:
    """``kvgym bench bandwidth``: bytes read per token against context length."""
    from cache.models import load_model
    from eval.bandwidth import check_bandwidth_args, describe_bandwidth, run_bandwidth

    check_bandwidth_args(args.chunk, args.corpus)  # before the model is loaded
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    summary = run_bandwidth(loaded.model, loaded.tokenizer, out_dir=args.out, max_tokens=args.max_tokens,
                            budget=args.budget, chunk=args.chunk, corpus=args.corpus, host_blocks=args.host_blocks,
                            model_name=args.model)
    print(describe_bandwidth(summary, args.out))
    return 0


def cmd_train(args) -> int:
    """``kvgym train``: the ranking policy's whole training from a config (``agents.ranker.pipeline``)."""
    from agents.ranker.pipeline import load_config, train_pipeline

    train_pipeline(load_config(args.config, args.overrides), resume=args.resume)
    return 0


def cmd_tensorboard(args) -> int:
    """``kvgym tensorboard``: serve a runs folder."""
    import subprocess

    args.logdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(args.logdir), "--port", str(args.port)]
    print(" ".join(command))
    return subprocess.call(command)


def cmd_peer(args) -> int:
    """``kvgym peer``: kvgym's records beside kvpress's on the same samples."""
    from eval.peer import compare, markdown, parse_pairs
    from eval.report import records_file

    for path in (args.samples, args.peer):
        if not records_file(path).is_file():
            raise ValueError(f"{path}: no such file; give a samples.jsonl and a kvpress results file")
    rows = compare(args.samples, args.peer, parse_pairs(args.pair))
    if not rows:
        raise ValueError(f"{args.samples}: no controller with a kvpress counterpart on the same sample indexes")
    print(markdown(rows))
    return 0


def cmd_compare(args) -> int:
    """``kvgym compare``: one controller against every other on the samples both ran."""
    from eval.report import (
        COMPARE_FIELDS,
        paired_differences,
        paired_differences_md,
        read_jsonl,
        records_file,
    )

    if not records_file(args.samples).is_file():
        raise ValueError(f"--samples {args.samples}: no such file; give a samples.jsonl written by kvgym eval")
    rows = paired_differences(read_jsonl(args.samples, COMPARE_FIELDS), args.controller)
    if not rows:
        raise ValueError(f"{args.samples}: no other controller ran the same samples at {args.controller}'s budgets")
    if args.json is not None:
        write_json(rows, args.json)
    print(paired_differences_md(rows))
    return 0


def cmd_report(args) -> int:
    """``kvgym eval`` summarises the cells it was asked for; runs added to one folder by several commands (other
    controllers, budgets or n) are summarised together here. A record run twice (same key) counts once. With
    ``--leaderboard`` the methods of every folder are ranked per setting (``eval.leaderboard``)."""
    from eval.report import report_folder

    if args.leaderboard is not None:
        from eval.leaderboard import leaderboard_md, write_leaderboard

        boards = write_leaderboard(args.folders, args.leaderboard, args.min_full, plots=not args.no_plots)
        print(leaderboard_md(boards))
        print(f"wrote {args.leaderboard / 'leaderboard.md'}, leaderboard.json" + ("" if args.no_plots else ", leaderboard.png"))
        return 0
    if len(args.folders) > 1:
        raise ValueError(f"report: {len(args.folders)} folders given; one folder's summary at a time, or several "
                         "with --leaderboard OUT")
    rows, records = report_folder(args.folders[0], plots=not args.no_plots)
    print(f"{args.folders[0] / 'summary.md'}: {len(rows)} rows from {len(records)} records")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input ends with a message and exit code 2, Ctrl-C with 130."""
    args = build_parser().parse_args(argv)
    handlers = {"setup": cmd_setup, "generate": cmd_generate, "bench": cmd_bench,
                "eval": cmd_eval, "train": cmd_train, "tensorboard": cmd_tensorboard,
                "peer": cmd_peer, "compare": cmd_compare, "report": cmd_report}
    name = f"{args.command} {args.bench}" if args.command == "bench" else args.command
    return run_handler(name, handlers[args.command], args)


def run_handler(name: str, handler, args) -> int:
    """``handler(args)``; bad input ends with a message and exit code 2, Ctrl-C with 130."""
    from cache.models import ModelBuildError
    from eval.tasks.corpora import CorpusError

    try:
        return handler(args)
    except (ValueError, OSError, ModelBuildError, CorpusError) as err:  # bad input, files, what cannot be built
        print(f"kvgym {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # every record written so far is kept; eval, train and collect resume
        print(f"kvgym {name}: interrupted; what was written is kept (rerun the same command to resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
