"""The ranking policy's research commands (moved out of the product's command line): collect decision points,
train a scorer with chosen targets, PPO on the one-step replay, held-out regret, live KL training and comparison,
replay-vs-live fidelity. The product's one training command is ``kvgym train`` (``agents.ranker.pipeline``).

Run from the repository root: ``python -m benchmarks.ranker_tools <command> [options]`` (``--help`` per command);
BENCHMARKS.md names the command behind each figure it reports.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from kvgym.arguments import add_model_args, checked_tasks, parse_fraction_list, parse_int_list
from kvgym.cli import run_handler
from kvgym.reports import write_json


def _add_ranker_sample_args(parser: argparse.ArgumentParser) -> None:
    """The task samples a live ranker command prefills: tasks, prompt length, budgets, chat template."""
    parser.add_argument("--tasks", default="passkey,niah_single,niah_multikey")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budgets", type=parse_fraction_list, default=[0.125, 0.25])
    parser.add_argument("--no-chat", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The research commands' parser."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ranker_tools", description=__doc__.split("\n\n")[0])
    ranker_kinds = parser.add_subparsers(dest="ranker", required=True)
    ranker_collect = ranker_kinds.add_parser(
        "collect", help="oneshot-question decision points of task samples: block features + future attention (.pt)")
    add_model_args(ranker_collect)
    ranker_collect.add_argument("--tasks", default="passkey,niah_single,niah_multikey,niah_multivalue,vt")
    ranker_collect.add_argument("--lengths", type=parse_int_list, default=[2048])
    ranker_collect.add_argument("--n", type=int, default=12, help="samples per task and length")
    ranker_collect.add_argument("--seed", type=int, default=101,
                                help="draws the samples: keep it apart from the seeds you evaluate on")
    ranker_collect.add_argument("--no-chat", action="store_true", help="plain prompts (default: the chat template)")
    ranker_collect.add_argument("--block-size", type=int, default=16)
    ranker_collect.add_argument("--out", type=Path, required=True, help="folder of .pt files (reruns resume)")
    ranker_collect.add_argument("--drivers", default="",
                                help="controllers (specs, comma-separated) that drive a streaming prefill: each "
                                     "sample's streaming question-point state under each is recorded too")
    ranker_collect.add_argument("--streaming-budgets", type=parse_fraction_list, default=[0.25],
                                help="budgets of the streaming runs (fractions of the context)")
    ranker_collect.add_argument("--host-blocks", type=int, default=512, help="host tier of the streaming runs")
    ranker_collect.add_argument("--blind", action="store_true",
                                help="also each sample's question-blind decision point (oneshot: the context alone "
                                     "prefilled, as in kvpress's pipeline)")
    ranker_collect.add_argument("--teacher", choices=["kvzip"], default=None,
                                help="with --blind: also record a teacher's block scores at the question-blind "
                                     "decision point (kvzip: KVzip's context-reconstruction attention)")
    ranker_collect.add_argument("--blind-only", action="store_true",
                                help="with --blind: record the question-blind decision points alone")
    ranker_train = ranker_kinds.add_parser("train", help="warm start on the oracle, then policy gradient on the regret")
    ranker_train.add_argument("--train", type=Path, required=True, help="a folder from `python -m benchmarks.ranker_tools collect`")
    ranker_train.add_argument("--validation", type=Path, required=True,
                              help="another folder (other samples): picks the checkpoint")
    ranker_train.add_argument("--warm-epochs", type=int, default=30)
    ranker_train.add_argument("--rl-epochs", type=int, default=30)
    ranker_train.add_argument("--seed", type=int, default=0)
    ranker_train.add_argument("--target", choices=["future", "teacher", "teacher_kept", "future_value"],
                              default="future",
                              help="what a ranking is scored against: the future attention (default), the "
                                   "teacher's scores of records collected with `--teacher` (teacher_kept: the share "
                                   "of KV heads that keep each block when kvpress's rule, global over layers and per "
                                   "KV head, selects on them at the row's budget), or the future attention "
                                   "times the blocks' value norms (records collected since they are recorded)")
    ranker_train.add_argument("--needle-weight", type=float, default=0.0,
                              help="add the blocks that state the answer to the target, worth this many times the "
                                   "rest of the layer (0: off)")
    ranker_train.add_argument("--budgets", type=parse_fraction_list, default=[0.125, 0.25, 0.5],
                              help="fractions of the context each one-shot decision point is scored at")
    ranker_train.add_argument("--drop-features", default="",
                              help="comma-separated features or groups (place, attention, page_bound, keys, "
                                   "query_similarity, context) the scorer must not read (ablations)")
    ranker_train.add_argument("--out", type=Path, required=True,
                              help="run folder: ranker.pt, warm_start.pt, metrics.jsonl, tensorboard/, summary.json")

    ranker_ppo = ranker_kinds.add_parser(
        "ppo", help="PPO (stable-baselines3) of the ranking policy on the replay of decision points (agents.ranker.ppo)")
    ranker_ppo.add_argument("--train", type=Path, required=True, help="a folder from `python -m benchmarks.ranker_tools collect`")
    ranker_ppo.add_argument("--validation", type=Path, required=True,
                            help="another folder (other samples): picks the checkpoint")
    ranker_ppo.add_argument("--start", type=Path, default=None,
                            help="a ranker file to start from (e.g. a warm start, `ranker train --rl-epochs 0`); "
                                 "default: from scratch")
    ranker_ppo.add_argument("--timesteps", type=int, default=500_000, help="decisions (one-step episodes) in all")
    ranker_ppo.add_argument("--lr", type=float, default=1e-4)
    ranker_ppo.add_argument("--log-std-init", type=float, default=0.0,
                            help="starting log std of the Gaussian exploration noise on the keep scores")
    ranker_ppo.add_argument("--fixed-std", action="store_true",
                            help="keep the exploration noise at --log-std-init (default: learned, and it shrinks)")
    ranker_ppo.add_argument("--envs", type=int, default=8)
    ranker_ppo.add_argument("--n-steps", type=int, default=256, help="rollout steps per env between updates")
    ranker_ppo.add_argument("--epochs", type=int, default=4, help="PPO epochs per rollout")
    ranker_ppo.add_argument("--batch", type=int, default=256,
                            help="PPO minibatch size (rows of a rollout of --envs x --n-steps rankings)")
    ranker_ppo.add_argument("--group", type=int, default=1,
                            help="envs per decision: each group of this many envs shows one decision and each "
                                 "ranking is rewarded against the others' mean (leave-one-out); 1: plain PPO")
    ranker_ppo.add_argument("--eval-every", type=int, default=50_000, help="steps between validation scorings")
    ranker_ppo.add_argument("--seed", type=int, default=0)
    ranker_ppo.add_argument("--resume", action="store_true", help="continue OUT/last.zip (after a kill)")
    ranker_ppo.add_argument("--out", type=Path, required=True,
                            help="run folder: ppo.zip and ranker.pt (best validation regret), last.zip, "
                                 "metrics.jsonl, tensorboard/, summary.json")

    ranker_regret = ranker_kinds.add_parser(
        "regret", help="ranker files and single-feature heuristics scored on held-out decision points: regret "
                       "per phase and budget, and the gap to the oracle each closes against a reference (Markdown, JSON)")
    ranker_regret.add_argument("--records", type=Path, required=True,
                               help="a folder from `python -m benchmarks.ranker_tools collect` that no training or checkpoint choice used")
    ranker_regret.add_argument("--policies", required=True,
                               help="NAME=PATH pairs, comma-separated (ranker files), e.g. "
                                    "warm=runs/a/warm_start.pt,pg=runs/a/ranker.pt")
    ranker_regret.add_argument("--reference", default=None, help="the NAME compared against (default: the first)")
    ranker_regret.add_argument("--json", type=Path, default=None, help="also write the report here")

    ranker_live = ranker_kinds.add_parser(
        "live-train", help="policy gradient on the live teacher-forced KL, from a ranker file (agents.ranker.live_train)")
    add_model_args(ranker_live)
    _add_ranker_sample_args(ranker_live)
    ranker_live.add_argument("--start", type=Path, default=Path("policies/ranker_smollm2.pt"), help="the ranker file to start from")
    ranker_live.add_argument("--train-seed", type=int, default=101, help="harness seed of the training samples")
    ranker_live.add_argument("--train-n", type=int, default=4, help="training samples per task")
    ranker_live.add_argument("--validation-seed", type=int, default=102, help="harness seed of the samples that pick the epoch")
    ranker_live.add_argument("--validation-n", type=int, default=2, help="validation samples per task")
    ranker_live.add_argument("--epochs", type=int, default=3)
    ranker_live.add_argument("--samples", type=int, default=8, help="rankings drawn per decision point")
    ranker_live.add_argument("--lr", type=float, default=3e-4)
    ranker_live.add_argument("--temperature", type=float, default=1.0, help="of the Plackett-Luce sampling")
    ranker_live.add_argument("--one-layer", action="store_true",
                             help="each decision point's rankings differ in one layer drawn at random (the others at their top-b)")
    ranker_live.add_argument("--seed", type=int, default=0)
    ranker_live.add_argument("--out", type=Path, required=True,
                             help="run folder: ranker.pt (best validation KL), metrics.jsonl, tensorboard/, summary.json")

    ranker_live_compare = ranker_kinds.add_parser(
        "live-compare", help="ranker files scored live (teacher-forced KL of their top-b) on held-out samples, paired (JSON)")
    add_model_args(ranker_live_compare)
    _add_ranker_sample_args(ranker_live_compare)
    ranker_live_compare.add_argument("--policies", required=True, help="NAME=PATH pairs, comma-separated (ranker files)")
    ranker_live_compare.add_argument("--reference", default=None, help="the NAME compared against (default: the first)")
    ranker_live_compare.add_argument("--seed", type=int, default=103, help="harness seed: keep it apart from training's")
    ranker_live_compare.add_argument("--n", type=int, default=4, help="samples per task")
    ranker_live_compare.add_argument("--json", type=Path, default=None, help="also write the report here")

    ranker_fidelity = ranker_kinds.add_parser(
        "fidelity", help="replay vs live: per episode, Spearman of replay regret and live KL over >= 8 rankings (JSON)")
    add_model_args(ranker_fidelity)
    _add_ranker_sample_args(ranker_fidelity)
    ranker_fidelity.add_argument("--policy", type=Path, default=Path("policies/ranker_smollm2.pt"))
    ranker_fidelity.add_argument("--n", type=int, default=2, help="samples per task")
    ranker_fidelity.add_argument("--seed", type=int, default=7, help="harness seed (keep it apart from training's)")
    ranker_fidelity.add_argument("--json", type=Path, required=True, help="where to write the rows and the summary")
    return parser


def cmd_ranker(args) -> int:
    """The ranking policy's collect / train / regret / ppo / live commands."""
    if args.ranker == "train":
        from agents.ranker.train import train

        sets = _train_and_validation_records(args)
        summary = train(sets["train"], sets["validation"], args.out, warm_epochs=args.warm_epochs,
                        rl_epochs=args.rl_epochs, seed=args.seed, target=args.target,
                        needle_weight=args.needle_weight,
                        drop_features=tuple(f.strip() for f in args.drop_features.split(",") if f.strip()),
                        budgets=tuple(args.budgets))
        print(json.dumps(summary["best"]), f"-> {args.out / 'ranker.pt'}")
        return 0
    if args.ranker == "ppo":
        from agents.ranker.ppo import train_ppo

        sets = _train_and_validation_records(args)
        summary = train_ppo(sets["train"], sets["validation"], args.out, timesteps=args.timesteps, start=args.start,
                            envs=args.envs, n_steps=args.n_steps, batch=args.batch, epochs=args.epochs, lr=args.lr,
                            log_std_init=args.log_std_init, learn_std=not args.fixed_std, eval_every=args.eval_every,
                            group=args.group, seed=args.seed, resume=args.resume)
        print(json.dumps(summary["best"]), f"-> {args.out / 'ppo.zip'}")
        return 0
    if args.ranker == "fidelity":
        return _ranker_fidelity(args)
    if args.ranker == "live-train":
        return _ranker_live_train(args)
    if args.ranker == "live-compare":
        return _ranker_live_compare(args)
    if args.ranker == "regret":
        return _ranker_regret(args)
    from agents.registry import make_controller
    from cache.models import load_model
    from kvgym.envs.decisions import collect, driver_name

    tasks = checked_tasks(args.tasks)
    drivers = {driver_name(spec): make_controller(spec)
               for spec in (s.strip() for s in args.drivers.split(",")) if spec}
    teacher = None
    if args.teacher == "kvzip":
        from agents.baselines.kvzip import KVzip, reconstruction_mass

        teacher = ("kvzip", functools.partial(reconstruction_mass, chunk_size=KVzip.chunk_size))
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    paths = collect(loaded.model, loaded.tokenizer, tasks, args.lengths, args.n, args.seed, args.out,
                    chat=not args.no_chat, block_size=args.block_size, drivers=drivers,
                    streaming_budgets=tuple(args.streaming_budgets), host_blocks=args.host_blocks, blind=args.blind,
                    teacher=teacher, blind_only=args.blind_only)
    print(f"{len(paths)} decision points in {args.out}")
    return 0


def _train_and_validation_records(args) -> dict[str, list[dict]]:
    """``--train`` and ``--validation``'s decision points, loaded (``ranker train`` / ``ranker ppo``)."""
    from kvgym.envs.decisions import load_records

    return {name: load_records(_decision_files(getattr(args, name), f"--{name}")) for name in ("train", "validation")}


def _decision_files(folder: Path, option: str) -> list[Path]:
    paths = sorted(folder.glob("*.pt")) if folder.is_dir() else []
    if not paths:
        raise ValueError(f"{option} {folder}: no decision points (.pt) there; make them with `python -m benchmarks.ranker_tools collect`")
    return paths


def _ranker_files(text: str) -> dict[str, Path]:
    """``--policies``: NAME=PATH pairs, comma-separated → name → ranker file."""
    files = {}
    for pair in (p.strip() for p in text.split(",") if p.strip()):
        name, _, path = pair.partition("=")
        if not name or not path:
            raise ValueError(f"--policies: expected NAME=PATH pairs, got {pair!r}")
        if name in files:
            raise ValueError(f"--policies: the name {name!r} is given twice ({files[name]} and {path}); "
                             "give each file its own name")
        files[name] = Path(path)
    if not files:
        raise ValueError("--policies: expected NAME=PATH pairs, got none")
    return files


def _ranker_regret(args) -> int:
    import torch

    from agents.ranker.model import load_ranker
    from agents.ranker.train import heuristic_scores
    from eval.regret_compare import compare_rankings, comparison_md
    from kvgym.envs.decisions import Decisions, load_records

    files = _ranker_files(args.policies)
    decisions = Decisions(load_records(_decision_files(args.records, "--records")))
    rankings = {}
    with torch.no_grad():
        for name, path in files.items():
            rankings[name] = load_ranker(path)[0](decisions.features)[0]
    rankings |= heuristic_scores(decisions)
    report = compare_rankings(decisions, rankings, args.reference or next(iter(files)))
    report["files"] = {name: str(path) for name, path in files.items()}
    print(comparison_md(report), end="")
    if args.json:
        write_json(report, args.json)
    return 0


def _ranker_fidelity(args) -> int:
    from agents.ranker.model import load_ranker
    from cache.models import load_model
    from eval.ranking_fidelity import (
        FEATURE_POLICIES,
        REPLAY_TARGETS,
        episode_table,
        feature_score,
        fidelity_summary,
        random_score,
    )
    from eval.tasks import generate
    from eval.tasks.prompt import build_prompt

    tasks = checked_tasks(args.tasks)
    ranker, _ = load_ranker(args.policy)
    policies = {f"ranker:{args.policy}": lambda features: ranker(features.float())[0],
                **{name: feature_score(column) for name, column in FEATURE_POLICIES.items()},
                "random": random_score(0)}
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = loaded.tokenizer
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    rows = []
    for task in tasks:
        for index in range(args.n):
            sample = generate(task, tokenizer, args.length, seed=args.seed, index=index)
            prompt = build_prompt(tokenizer, sample, not args.no_chat)
            for row in episode_table(loaded.model, prompt, policies, args.budgets,
                                     max_new_tokens=min(sample.max_new_tokens, 24), eos_ids=eos):
                rows.append({"sample": f"{task}/{index}", **row})
            print(f"{task}/{index}: {len(rows)} rows", flush=True)
    summaries = {target: fidelity_summary(rows, column) for target, column in REPLAY_TARGETS.items()}
    write_json({"model": args.model, "length": args.length, "seed": args.seed, "tasks": tasks,
                  "summary": summaries["future"], "summary_by_target": summaries, "rows": rows}, args.json)
    print(json.dumps({target: {k: v for k, v in summary.items() if k != "episodes"} for target, summary in summaries.items()}))
    return 0


def _ranker_live_compare(args) -> int:
    from agents.ranker.live_train import evaluate, live_points
    from agents.ranker.model import load_ranker
    from cache.models import load_model
    from eval.regret_compare import live_kl_comparison

    tasks = checked_tasks(args.tasks)
    files = _ranker_files(args.policies)
    scorers = {name: load_ranker(path)[0] for name, path in files.items()}
    reference = args.reference or next(iter(scorers))
    if reference not in scorers:
        raise ValueError(f"--reference {reference!r}: not one of the --policies names ({', '.join(scorers)})")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    points = live_points(loaded.model, loaded.tokenizer, tasks, args.length, args.n, args.seed, chat=not args.no_chat)
    kls = {name: evaluate(scorer, points, args.budgets)["kls"] for name, scorer in scorers.items()}
    keys = [(point.name, budget) for point in points for budget in args.budgets]  # evaluate's order
    report = live_kl_comparison(kls, [sample for sample, _ in keys], reference)
    report |= {"seed": args.seed, "budgets": list(args.budgets), "tasks": tasks, "length": args.length,
               "files": {name: str(path) for name, path in files.items()},
               "rows": [{"sample": sample, "budget": budget, **{name: kls[name][i] for name in kls}}
                        for i, (sample, budget) in enumerate(keys)]}
    print(json.dumps({k: report[k] for k in ("mean_kl", "against_reference")}, indent=1))
    if args.json:
        write_json(report, args.json)
    return 0


def _ranker_live_train(args) -> int:
    from agents.ranker.live_train import live_points, train_live
    from agents.ranker.model import load_ranker
    from cache.models import load_model

    tasks = checked_tasks(args.tasks)
    load_ranker(args.start)  # a bad file is refused before the model loads
    if args.train_seed == args.validation_seed:
        raise ValueError(f"--validation-seed {args.validation_seed}: the validation samples must not be the training ones")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    sets = {name: live_points(loaded.model, loaded.tokenizer, tasks, args.length, n, seed, chat=not args.no_chat)
            for name, n, seed in (("train", args.train_n, args.train_seed), ("validation", args.validation_n, args.validation_seed))}
    summary = train_live(sets["train"], sets["validation"], args.start, args.out, budgets=args.budgets, epochs=args.epochs,
                         samples=args.samples, lr=args.lr, temperature=args.temperature, one_layer=args.one_layer,
                         seed=args.seed)
    print(json.dumps(summary["best"]), f"-> {args.out / 'ranker.pt'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one research command (bad input: exit 2, as the product's commands)."""
    args = build_parser().parse_args(argv)
    return run_handler(f"ranker_tools {args.ranker}", cmd_ranker, args)


if __name__ == "__main__":
    sys.exit(main())
