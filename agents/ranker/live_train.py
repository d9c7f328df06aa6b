"""Policy gradient on the **live** reward: what RL can add where the attention oracle is not the answer.

Imitating the future-attention oracle and policy gradient on its regret end level (benchmarks/HISTORY.md, "What RL
adds"): the regret is a deterministic function of the kept set and the oracle is known, so the imitation
target already carries what a sampled gradient estimates. The live reward is different: the teacher-forced KL
of the compressed cache's next-token distributions from the full cache's (``LiveDecision``), which ranks
policies differently from the regret (benchmarks/HISTORY.md, "Replay fidelity": key norm and random rankings do better
live than their regret says). No oracle gives that ranking; sampling and trying does.

Each decision point (a ``oneshot-question`` compression of one task sample, at one budget) is a contextual
bandit over all 30 layers at once: ``samples`` rankings are drawn from the Plackett–Luce distribution of the
scorer's scores per layer (``plackett_luce_topk``), each applied live, and REINFORCE weighs the joint
log-probability (summed over layers) by the ranking's KL against the leave-one-out mean of the group,
divided by the group's spread, GRPO-style, so every decision point counts alike whatever its KL scale (the
spread is floored at ``SPREAD_FLOOR``: a group whose draws all keep or all lose the answer differs only by
rounding, and must not be blown up to unit scale). With ``one_layer`` the rankings of a group differ in one
layer drawn at random (the others at their top-b), so the advantage is credited to that layer's choice instead
of being shared by 30 layers' draws. The run starts from a trained ranker file; each epoch the deterministic top-b is scored live on validation decision
points (mean KL, and the attention regret to watch the drift from the oracle); the best epoch by validation KL
is saved with ``save_ranker``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from agents.ranker.model import load_ranker, save_ranker
from agents.ranker.train import plackett_luce_topk
from cache.paged_cache import CacheConfig
from cache.runner import Runner
from kvgym.envs.decisions import Decisions, LiveDecision, decision_point

SPREAD_FLOOR = 1e-3  # nats: the smallest group spread the advantage is divided by


@dataclass
class LivePoint:
    """One task sample's decision point, ready to score rankings live at any budget."""
    name: str
    record: dict
    live: LiveDecision


@torch.no_grad()
def live_points(model, tokenizer, tasks: list[str], length: int, n: int, seed: int, chat: bool = True,
                log=print) -> list[LivePoint]:
    """``n`` samples of each task (harness ``seed``): a dense prefill each, its decision point and answer."""
    from eval.tasks import generate
    from eval.tasks.prompt import build_prompt

    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    points = []
    for task in tasks:
        for index in range(n):
            sample = generate(task, tokenizer, length, seed=seed, index=index)
            prompt = build_prompt(tokenizer, sample, chat)
            new_tokens = min(sample.max_new_tokens, 24)
            shared = Runner(model, None, CacheConfig(block_size=16), protocol="oneshot-question").dense_prefill(
                prompt, new_tokens)
            record = decision_point(model, prompt, new_tokens, eos_ids=eos, shared=shared)
            points.append(LivePoint(f"{task}/{index}", record, LiveDecision(model, prompt, shared, record["answer"].tolist())))
            log(f"prepared {task}/{index} (seed {seed})")
    return points


def evaluate(scorer, points: list[LivePoint], budgets) -> dict:
    """Mean live KL and attention regret of the scorer's deterministic top-b over ``points`` × ``budgets``."""
    kls, regrets = [], []
    with torch.no_grad():
        for point in points:
            for budget in budgets:
                decisions = Decisions([point.record], budgets=(budget,))
                scores = scorer(decisions.features)[0]
                kls.append(point.live.kl(scores, budget))
                regrets.append(float(decisions.regret(scores).mean()))
    return {"kl": sum(kls) / len(kls), "regret": sum(regrets) / len(regrets), "kls": kls}


def train_live(train: list[LivePoint], validation: list[LivePoint], start: str | Path, out: str | Path,
               budgets=(0.125, 0.25), epochs: int = 3, samples: int = 8, lr: float = 3e-4,
               temperature: float = 1.0, one_layer: bool = False, seed: int = 0, log=print) -> dict:
    """REINFORCE on the live KL from the ranker file ``start`` (``one_layer``: each decision point's rankings
    differ in one layer drawn at random, the others keep their top-b, so the credit goes to that layer); writes
    ``out/ranker.pt`` (best validation KL, the start included), ``out/metrics.jsonl`` (``flat_groups``: the share
    of decision points whose draws all scored within ``SPREAD_FLOOR``), TensorBoard events and ``out/summary.json``."""
    from torch.utils.tensorboard import SummaryWriter

    if samples < 2:
        raise ValueError(f"samples: a leave-one-out baseline needs >= 2 rankings per decision point, got {samples}")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    scorer, start_summary = load_ranker(start)
    writer = SummaryWriter(str(out / "tensorboard"))
    metrics = (out / "metrics.jsonl").open("w")
    summary = {"start": str(start), "train_points": [p.name for p in train], "validation_points": [p.name for p in validation],
               "budgets": list(budgets), "epochs": epochs, "samples": samples, "lr": lr, "temperature": temperature,
               "one_layer": one_layer, "seed": seed}
    best = {"kl": math.inf}

    def checkpoint(epoch: int, train_kl: float, flat: float | None = None) -> None:
        scorer.eval()
        held = evaluate(scorer, validation, budgets)
        row = {"epoch": epoch, "train_sampled_kl": None if math.isnan(train_kl) else train_kl,
               "validation_kl": held["kl"], "validation_regret": held["regret"], "flat_groups": flat}
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
        writer.add_scalar("live/validation_kl", held["kl"], epoch)
        writer.add_scalar("live/validation_regret", held["regret"], epoch)
        if not math.isnan(train_kl):
            writer.add_scalar("live/train_sampled_kl", train_kl, epoch)
            writer.add_scalar("live/flat_groups", flat, epoch)
        if held["kl"] < best["kl"]:
            best.update(kl=held["kl"], regret=held["regret"], epoch=epoch)
            save_ranker(scorer, out / "ranker.pt", {**start_summary, "live_training": {**summary, "best": dict(best)}})
        log(f"epoch {epoch}: sampled train KL {train_kl:.4f}  validation KL {held['kl']:.4f}  regret {held['regret']:.4f}")
        scorer.train()

    groups = [(point, budget, Decisions([point.record], budgets=(budget,))) for point in train for budget in budgets]
    optimiser = torch.optim.Adam(scorer.parameters(), lr=lr)
    checkpoint(0, float("nan"))
    for epoch in range(1, epochs + 1):
        rng.shuffle(groups)
        sampled, flat = [], 0
        for point, budget, decisions in groups:
            scores = scorer(decisions.features)[0]
            keys, log_prob = plackett_luce_topk(scores, decisions.candidates, decisions.room, samples, temperature)
            if one_layer:  # one layer drawn, the others at their top-b: the advantage is that layer's alone
                layer = rng.randrange(keys.shape[1])
                drawn = keys[:, layer]
                keys = scores.detach().expand_as(keys).clone()
                keys[:, layer] = drawn
                log_prob = log_prob[:, layer:layer + 1]
            kl = torch.tensor([point.live.kl(k, budget) for k in keys])  # [S]
            baseline = (kl.sum() - kl) / (samples - 1)  # leave-one-out
            # lower KL than the others: positive; a group whose KLs differ by less than SPREAD_FLOOR nats is
            # not blown up to unit scale (that would turn rounding-level differences into full-size noise)
            advantage = (baseline - kl) / kl.std().clamp(min=SPREAD_FLOOR)
            loss = -(advantage * log_prob.sum(dim=-1)).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            sampled.append(float(kl.mean()))
            flat += bool(kl.std() < SPREAD_FLOOR)
        checkpoint(epoch, sum(sampled) / len(sampled), flat / len(groups))
    summary["best"] = best
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    writer.close()
    metrics.close()
    return summary
