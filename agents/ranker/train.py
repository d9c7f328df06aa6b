"""Training the ranking policy on exact, per-decision rewards from full-cache traces.

**Decision points** (``collect``): for each training sample, the ``oneshot-question`` protocol's one decision
(the prompt but its last token prefilled densely, so the question's queries are in the statistics): every
block's ``block_features`` there, and its **future attention**, per query head: the mass the full cache's
last prompt token and greedy answer give each block (``[L, H, N]``). One ``.pt`` file per sample, written
once (a killed collection resumes where it stopped).

**Reward** (``kvgym.envs.reward.ranking_regret``): per layer, the future mass (max over query heads: retrieval
heads count) of the blocks a ranking leaves off the device, minus what the future-attention oracle leaves off
from the same state, over the layer's total: 0 is the oracle, samples and budgets compare. A decision is
one layer of one sample at one budget (0.125 / 0.25 / 0.5 of the context): a contextual bandit, so credit
assignment is exact.

**Training** (``train``), after KVP (arXiv 2602.10238) and the warm-start advice of ``research/rl.md`` §8:

1. warm start: listwise cross-entropy between the softmax of the scores and the normalised future mass of
   each layer's candidates (imitating the oracle);
2. policy gradient on the regret: a ranking is sampled from the Plackett–Luce distribution of the scores
   (Gumbel top-k), its kept set scored by ``ranking_regret``, REINFORCE with a leave-one-out baseline over the
   ``samples`` rankings drawn per decision.

Every epoch logs the validation regret of the deterministic top-b (and of single heuristic features on the
same decisions, for comparison) to TensorBoard and ``metrics.jsonl``; the best checkpoint by validation regret
is saved (``save_ranker``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from agents.policy_file import atomic_write
from agents.ranker.model import BlockScorer, save_ranker
from cache.ranking import RANK_FEATURES
from kvgym.envs.decisions import BUDGETS, Decisions

# single features that are themselves a heuristic's ranking, for the validation table
HEURISTIC_COLUMNS = {
    "window_mean (SnapKV-like, no pooling)": "last_mean_rank",
    "window_max": "last_max_rank",
    "last_query_mean (TOVA)": "last_query_mean_rank",
    "observed_mean (observed attention)": "observed_mean_rank",
    "key_norm (Knorm)": "key_norm_rank",
    "page_bound_max (Quest)": "page_bound_max_rank",
    "window_bound_max (Quest, window vote)": "window_bound_max_rank",
    "key_distinct (KeyDiff-like)": "key_distinct_rank",
}


def heuristic_scores(decisions: Decisions) -> dict[str, torch.Tensor]:
    """Each single heuristic feature of ``HEURISTIC_COLUMNS`` as keep scores ``[R, N]`` of ``decisions``."""
    return {name: decisions.features[..., RANK_FEATURES.index(column)] for name, column in HEURISTIC_COLUMNS.items()}


# ------------------------------------------------------------------------------------------------ train
def regret_table(decisions: Decisions, model: BlockScorer | None) -> dict[str, dict[str, float]]:
    """Mean regret of the deterministic top-b per budget and per decision phase on ``decisions`` (phases:
    ``compress`` = one-shot, the others streaming states): ``model`` and each single heuristic feature of
    ``HEURISTIC_COLUMNS``."""
    methods = heuristic_scores(decisions)
    if model is not None:
        with torch.no_grad():
            methods = {"ranker": model(decisions.features)[0], **methods}
    return {name: decisions.regret_by(scores) for name, scores in methods.items()}


def listwise_loss(scores: torch.Tensor, mass: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Cross-entropy between the target's share of ``mass`` and the softmax of ``scores`` over the candidates."""
    target = torch.where(candidates, mass.clamp(min=0), torch.zeros(()))
    target = target / target.sum(dim=-1, keepdim=True).clamp(min=1e-12)
    log_q = torch.log_softmax(scores.masked_fill(~candidates, -1e9), dim=-1)
    return -(target * log_q.masked_fill(~candidates, 0.0)).sum(dim=-1).mean()


def plackett_luce_topk(scores: torch.Tensor, candidates: torch.Tensor, room: torch.Tensor, samples: int,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` rankings per row drawn from the Plackett–Luce distribution of ``scores / temperature``
    (Gumbel perturbation); returns each ranking's sort keys ``[S, R, N]`` (its top-``room`` is the kept set)
    and the log-probability of drawing its top-``room`` in that order ``[S, R]``."""
    logits = (scores / temperature).masked_fill(~candidates, -1e9)
    gumbel = -torch.log(-torch.log(torch.rand(samples, *logits.shape).clamp(1e-9, 1 - 1e-9)))
    keys = (logits.detach() + gumbel).masked_fill(~candidates, -torch.inf)
    order = torch.argsort(keys, dim=-1, descending=True)
    ordered = torch.gather(logits.expand(samples, -1, -1), -1, order)
    suffix = torch.logcumsumexp(ordered.flip(-1), dim=-1).flip(-1)  # log Σ over the not-yet-drawn
    steps = torch.arange(logits.shape[-1])
    take = (steps < room[:, None]) & torch.gather(candidates.expand(samples, -1, -1), -1, order)
    return keys, ((ordered - suffix) * take).sum(dim=-1)


FEATURE_GROUPS = {  # for ablations: what each group of RANK_FEATURES tells the scorer
    "place": ("position", "distance_from_end", "layer_depth"),
    "attention": tuple(f for f in RANK_FEATURES if f.startswith(("last_", "observed_"))),
    "page_bound": tuple(f for f in RANK_FEATURES if f.startswith("page_bound_")),
    "window_bound": tuple(f for f in RANK_FEATURES if f.startswith("window_bound_")),
    "keys": ("key_norm_rank", "key_distinct_rank"),
    "query_similarity": ("query_similarity", "query_similarity_rank"),
    "context": tuple(f for f in RANK_FEATURES if f.startswith(("tier_", "phase_", "layer_")) and f != "layer_depth")
    + ("sentence_boundary",),
}


def dropped_columns(drop: tuple[str, ...]) -> list[int]:
    """Column indexes of ``drop``: feature names of ``RANK_FEATURES`` or group names of ``FEATURE_GROUPS``."""
    names = []
    for item in drop:
        if item in FEATURE_GROUPS:
            names += FEATURE_GROUPS[item]
        elif item in RANK_FEATURES:
            names.append(item)
        else:
            raise ValueError(f"drop_features: {item!r} is neither a feature ({', '.join(RANK_FEATURES)}) nor a group "
                             f"({', '.join(FEATURE_GROUPS)})")
    return sorted({RANK_FEATURES.index(name) for name in names})


def blind_to(model: BlockScorer, columns: list[int]) -> None:
    """Make ``model`` ignore the feature ``columns``: their first-layer weights are zeroed and kept at zero by
    zeroing their gradient, so the scorer (and its ``NumpyScorer``, whatever the inputs there) never reads them."""
    if not columns:
        return
    weight = model.body[0].weight
    with torch.no_grad():
        weight[:, columns] = 0.0
    mask = torch.ones_like(weight)
    mask[:, columns] = 0.0
    weight.register_hook(lambda grad: grad * mask)


def train(records: list[dict], validation: list[dict], out: str | Path, warm_epochs: int = 30, rl_epochs: int = 30,
          samples: int = 8, batch: int = 256, lr: float = 3e-3, rl_lr: float = 1e-3, hidden: int = 64,
          seed: int = 0, target: str = "future", needle_weight: float = 0.0, drop_features: tuple[str, ...] = (),
          budgets: tuple[float, ...] = BUDGETS, resume: bool = False, log=print) -> dict:
    """Train a ``BlockScorer`` (warm start, then policy gradient); writes ``out/ranker.pt`` (best by validation
    regret), ``out/warm_start.pt`` (the warm start alone), ``out/metrics.jsonl``, TensorBoard events and
    ``out/summary.json``. ``target``: what a ranking's regret is measured against (``Decisions``): the future
    attention, or the teacher's scores (records collected with one: the warm start then imitates the teacher),
    with ``needle_weight`` for the blocks that state the answer (``Decisions``). ``drop_features``: features or
    ``FEATURE_GROUPS`` the scorer must not read (``blind_to``; recorded in the file's summary). ``budgets``: the
    fractions of the context each one-shot decision point is scored at (streaming states keep their own).

    After every epoch the run's state (weights, optimiser, random generator, best so far) is written atomically
    to ``out/last.pt``; ``resume`` continues from it (a killed run loses at most one epoch, and the epochs after
    it are those an unbroken run would have made). Without ``resume`` an ``out`` that holds a ``last.pt`` is
    refused rather than overwritten."""
    from torch.utils.tensorboard import SummaryWriter

    if warm_epochs < 0 or rl_epochs < 0 or warm_epochs + rl_epochs == 0:
        raise ValueError(f"ranker train: epochs must be >= 0 and not both 0 (got warm {warm_epochs}, "
                         f"policy gradient {rl_epochs}): an untrained file is not a policy")
    columns = dropped_columns(tuple(drop_features))
    out = Path(out)
    state = _read_checkpoint(out / "last.pt") if resume else None
    if not resume and (out / "last.pt").exists():
        raise ValueError(f"{out} holds a training run (last.pt): pass --resume to continue it, or another folder")
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    data = Decisions(records, budgets=budgets, target=target, needle_weight=needle_weight)
    held = Decisions(validation, budgets=budgets, target=target, needle_weight=needle_weight)
    model = BlockScorer(len(RANK_FEATURES), hidden)
    model.set_normalisation(data.features[data.candidates])
    blind_to(model, columns)
    writer = SummaryWriter(str(out / "tensorboard"))
    best = {"regret": math.inf}
    summary = {"train_rows": len(data), "validation_rows": len(held), "train_samples": len(records),
               "validation_samples": len(validation), "budgets": list(budgets), "target": target,
               "needle_weight": needle_weight, "dropped_features": [RANK_FEATURES[c] for c in columns]}
    stages = [("warm", warm_epochs, lr), ("policy_gradient", rl_epochs, rl_lr)]
    done, saved_optimiser = 0, None
    if state is not None:
        if state["total_epochs"] != warm_epochs + rl_epochs or state["hidden"] != hidden:
            raise ValueError(f"--resume {out / 'last.pt'}: that run has {state['total_epochs']} epochs and hidden "
                             f"{state['hidden']}, this one {warm_epochs + rl_epochs} and {hidden}; resume with its "
                             "settings, or start in another folder")
        model.load_state_dict(state["model"])
        torch.set_rng_state(state["rng"])
        best, done, saved_optimiser = state["best"], state["epoch"], state["optimiser"]
        summary.update(state["summary"])
        log(f"resuming {out} after epoch {done} (best validation regret so far {best['regret']:.4f})")
        # rows of the epoch the kill interrupted (logged, not saved) are dropped: it runs again
        lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["epoch"] <= done]
        (out / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    metrics = (out / "metrics.jsonl").open("a" if state is not None else "w")

    def evaluate(epoch: int, stage: str, loss: float) -> None:
        model.eval()
        table = regret_table(held, model)
        regret = table["ranker"]["all"]
        row = {"epoch": epoch, "stage": stage, "loss": loss, "validation_regret": regret,
               "validation_regret_by": {k: v for k, v in table["ranker"].items() if k != "all"}}
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
        writer.add_scalar("ranker/validation_regret", regret, epoch)
        writer.add_scalar(f"ranker/{stage}_loss", loss, epoch)
        if regret < best["regret"]:
            best.update(regret=regret, epoch=epoch, stage=stage)
            save_ranker(model, out / "ranker.pt", {**summary, "best": dict(best)})
        log(f"{stage} epoch {epoch}: loss {loss:.4f}  validation regret {regret:.4f}")
        model.train()

    def warm_step(rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        scores, _ = model(data.features[rows])
        loss = listwise_loss(scores, data.mass[rows], data.candidates[rows])
        return loss, float(loss.detach())

    def policy_gradient_step(rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        scores, _ = model(data.features[rows])
        keys, log_prob = plackett_luce_topk(scores, data.candidates[rows], data.room[rows], samples)
        with torch.no_grad():
            reward = -torch.stack([data.regret(k, rows) for k in keys])  # [S, R]
            baseline = (reward.sum(dim=0, keepdim=True) - reward) / (samples - 1)  # leave-one-out
        return -((reward - baseline) * log_prob).mean(), float(-reward.mean())

    if done == 0:
        evaluate(0, "init", float("nan"))
    epoch = 0
    for stage, epochs, stage_lr in stages:
        first, last = epoch + 1, epoch + epochs
        epoch = last
        if done >= last:
            continue
        optimiser = torch.optim.Adam(model.parameters(), lr=stage_lr)
        if saved_optimiser is not None and first <= done:  # resumed inside this stage
            optimiser.load_state_dict(saved_optimiser)
        step = warm_step if stage == "warm" else policy_gradient_step
        for current in range(max(first, done + 1), last + 1):
            total = 0.0
            for rows in torch.randperm(len(data)).split(batch):
                loss, value = step(rows)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                total += value * len(rows)
            evaluate(current, stage, total / len(data))
            if stage == "warm" and current == last:
                save_ranker(model, out / "warm_start.pt", {**summary, "stage": "warm start only", "epochs": warm_epochs})
                summary["warm_start_validation"] = regret_table(held, model)["ranker"]
            _write_checkpoint(out / "last.pt", model, optimiser, current, warm_epochs + rl_epochs, best, summary)
    summary.update(best=best, validation=regret_table(held, None))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    writer.close()
    metrics.close()
    return summary


def _write_checkpoint(path: Path, model: BlockScorer, optimiser, epoch: int, total_epochs: int, best: dict,
                      summary: dict) -> None:
    """The run's state after ``epoch``, written atomically (``atomic_write``)."""
    state = {"format": "kvgym-ranker-train-state", "epoch": epoch, "total_epochs": total_epochs,
             "hidden": model.hidden, "model": model.state_dict(), "optimiser": optimiser.state_dict(),
             "rng": torch.get_rng_state(), "best": dict(best), "summary": dict(summary)}
    with atomic_write(path, ".pt") as tmp:
        torch.save(state, tmp)


def _read_checkpoint(path: Path) -> dict:
    """``last.pt`` of a run to resume, or a ``ValueError`` that names it and says what to do."""
    if not path.is_file():
        raise ValueError(f"--resume: {path} does not exist (no run to continue there); start without --resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (torch raises many kinds for a damaged file)
        raise ValueError(f"--resume: {path} cannot be read ({type(error).__name__}); delete it to start over") from None
    if not isinstance(state, dict) or state.get("format") != "kvgym-ranker-train-state":
        raise ValueError(f"--resume: {path} is not a kvgym training state; delete it to start over")
    return state
