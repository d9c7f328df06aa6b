"""PPO (stable-baselines3) of the ranking policy on the replay of recorded decisions.

The environment is ``kvgym.envs.decisions.RankingReplayEnv``: one-step episodes, one layer of one recorded
decision point at one budget; the action is a keep score per block, the reward ``-ranking_regret`` (exact, 0 =
the future-attention oracle), stepped for all envs at once by ``RankingReplayVecEnv`` (one batched regret per
step). ``RankingPolicy`` is an SB3 ``ActorCriticPolicy`` whose actor **is** a
``BlockScorer``: the mean of a Gaussian over every block's keep score, one learned standard deviation shared by
all blocks (only the candidates' scores enter the log-probability: padding and pinned rows decide nothing),
and whose critic maps the mean and spread of the candidates' (standardised) features to the expected reward. It
starts from a ranker file (the warm start: ``python -m benchmarks.ranker_tools train --rl-epochs 0``) or from scratch. With
``group`` > 1, groups of envs show the same decision and each sampled ranking is rewarded against the mean of
the others (``GroupRelativeReward``: the leave-one-out baseline of ``python -m benchmarks.ranker_tools train``'s REINFORCE).

``train_ppo`` runs SB3's ``PPO.learn`` with a callback that scores the deterministic scorer (the mean) on the
validation decisions every ``eval_every`` steps (TensorBoard, ``metrics.jsonl``), keeps the best as
``ranker.pt`` and ``ppo.zip``, and writes ``last.zip`` to resume a killed run from (``resume=True``).

``ppo.zip`` is SB3's ``model.save`` zip (``PPO.load`` opens it) with one more entry, ``kvgym_ranker.json``
(format, feature names, width, the sha256 of ``policy.pth``, the run's summary): ``load_ranker`` reads a
ranking policy from it without SB3 (``ranker:PATH.zip``). The merge head is not trained here (the action is
the keep scores): it stays the starting file's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.vec_env import VecEnv, VecEnvWrapper
from torch import nn

from agents.policy_file import save_sb3_zip
from agents.ranker.model import (
    PPO_ENTRY,
    PPO_FORMAT,
    RANKER_VERSION,
    BlockScorer,
    load_ranker,
    save_ranker,
)
from agents.ranker.train import regret_table
from cache.ranking import RANK_FEATURES
from kvgym.envs.decisions import Decisions, RankingReplayEnv, keep_scores

SCORE_BOUND = 1e4  # the env's action box: wide, so SB3's clipping leaves the scorer's logits (and their order) alone
LOG_2PI = math.log(2 * math.pi)


class RankingReplayVecEnv(VecEnv):
    """``num_envs`` ``RankingReplayEnv`` episodes stepped as one batch (SB3 ``VecEnv``): one gather of the rows'
    features and one ``Decisions.regret`` call for all envs per step, instead of a Python loop over envs (what
    ``DummyVecEnv`` does). Same spaces, rewards and infos as the single env; every step ends every episode and
    the returned observations are the next episodes' (``info["terminal_observation"]`` holds the ended one).

    ``group`` > 1: consecutive groups of that many envs show the same decision (a row drawn once per group), so
    that their sampled rankings can be rewarded against each other. Rows are drawn uniformly with ``seed``."""

    def __init__(self, decisions: Decisions, num_envs: int, score_bound: float = 1.0, group: int = 1, seed: int = 0):
        if num_envs < 1:
            raise ValueError(f"num_envs: expected at least one env, got {num_envs}")
        if group < 1 or num_envs % group:
            raise ValueError(f"group: expected a divisor of the {num_envs} envs, got {group}")
        single = RankingReplayEnv(decisions, score_bound=score_bound)
        self.render_mode = None
        super().__init__(num_envs, single.observation_space, single.action_space)
        self.decisions, self.group = decisions, group
        self.rng = np.random.default_rng(seed)
        self.rows = np.zeros(num_envs, np.int64)
        self._actions: np.ndarray | None = None
        self._observations: dict[str, np.ndarray] | None = None

    def _draw(self) -> dict[str, np.ndarray]:
        self.rows = np.repeat(self.rng.integers(len(self.decisions), size=self.num_envs // self.group), self.group)
        index = torch.from_numpy(self.rows)
        return {"blocks": self.decisions.features[index].numpy(),
                "candidates": self.decisions.candidates[index].numpy().astype(np.float32)}

    def reset(self) -> dict[str, np.ndarray]:
        self._observations = self._draw()
        return self._observations

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    def step_wait(self):
        if self._observations is None:
            raise RuntimeError("RankingReplayVecEnv.step before reset: call reset() first")
        actions = keep_scores(self._actions, (self.num_envs, *self.action_space.shape), "actions")
        self._actions = None
        regret = self.decisions.regret(torch.from_numpy(actions), torch.from_numpy(self.rows)).numpy()
        ended, budget = self._observations, self.decisions.budget[torch.from_numpy(self.rows)].tolist()
        infos = [{"regret": float(regret[i]), "row": int(self.rows[i]), "budget": budget[i],
                  "terminal_observation": {key: value[i] for key, value in ended.items()}}
                 for i in range(self.num_envs)]
        self._observations = self._draw()
        return self._observations, (-regret).astype(np.float32), np.ones(self.num_envs, bool), infos

    def close(self) -> None:
        pass

    def seed(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)
        return [seed] * self.num_envs

    def get_attr(self, attr_name: str, indices=None) -> list:
        return [getattr(self, attr_name) for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value, indices=None) -> None:
        setattr(self, attr_name, value)

    def env_method(self, method_name: str, *method_args, indices=None, **method_kwargs) -> list:
        raise AttributeError(f"RankingReplayVecEnv has no per-env method {method_name!r} (its envs are rows)")

    def env_is_wrapped(self, wrapper_class, indices=None) -> list[bool]:
        return [False for _ in self._get_indices(indices)]


class RankingPolicy(ActorCriticPolicy):
    """Gaussian keep scores around a ``BlockScorer``'s, for ``RankingReplayEnv``'s Dict observation; critic: an
    MLP of the candidates' feature mean and spread (cheap: the per-block work is the actor's). ``log_std_init``: the exploration noise's starting log std (in
    score units; the Plackett–Luce sampling of ``python -m benchmarks.ranker_tools train`` has Gumbel noise of std 1.28);
    ``learn_std`` False keeps it there (PPO otherwise shrinks it as the mean improves, and explores less)."""

    def __init__(self, observation_space, action_space, lr_schedule, hidden: int = 64, log_std_init: float = 0.0,
                 learn_std: bool = True, **kwargs):
        self.hidden, self.learn_std = hidden, learn_std
        kwargs["ortho_init"] = False  # the scorer has its own init (and may be loaded from a ranker file)
        super().__init__(observation_space, action_space, lr_schedule, log_std_init=log_std_init, **kwargs)

    def _build(self, lr_schedule) -> None:
        features = int(self.observation_space["blocks"].shape[-1])  # RANK_FEATURES' (an older zip: its own)
        self.scorer = BlockScorer(features, self.hidden)
        self.critic = nn.Sequential(nn.Linear(2 * features, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))
        self.log_std = nn.Parameter(torch.tensor(float(self.log_std_init)), requires_grad=self.learn_std)
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

    def _get_constructor_parameters(self) -> dict:
        return {**super()._get_constructor_parameters(), "hidden": self.hidden, "learn_std": self.learn_std}

    def _mean_and_candidates(self, obs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scorer(obs["blocks"])[0], obs["candidates"] > 0.5

    def _log_prob(self, mean: torch.Tensor, candidates: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        z = (actions - mean) / self.log_std.exp()
        return ((-0.5 * z * z - self.log_std - 0.5 * LOG_2PI) * candidates).sum(dim=-1)

    def predict_values(self, obs) -> torch.Tensor:
        blocks = (obs["blocks"].float() - self.scorer.feature_mean) / self.scorer.feature_std
        candidates = (obs["candidates"] > 0.5).unsqueeze(-1)
        mean = (blocks * candidates).sum(dim=1) / candidates.sum(dim=1).clamp(min=1)
        spread = (((blocks - mean[:, None]) * candidates) ** 2).sum(dim=1) / candidates.sum(dim=1).clamp(min=1)
        return self.critic(torch.cat([mean, spread.sqrt()], dim=-1))

    def _sample(self, mean: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return mean if deterministic else mean + self.log_std.exp() * torch.randn_like(mean)

    def forward(self, obs, deterministic: bool = False):
        mean, candidates = self._mean_and_candidates(obs)
        actions = self._sample(mean, deterministic)
        return actions, self.predict_values(obs), self._log_prob(mean, candidates, actions)

    def evaluate_actions(self, obs, actions: torch.Tensor):
        mean, candidates = self._mean_and_candidates(obs)
        entropy = candidates.sum(dim=-1) * (0.5 + 0.5 * LOG_2PI + self.log_std)
        return self.predict_values(obs), self._log_prob(mean, candidates, actions), entropy

    def get_distribution(self, obs):
        raise NotImplementedError("RankingPolicy samples its Gaussian scores itself (forward, evaluate_actions)")

    def _predict(self, observation, deterministic: bool = False) -> torch.Tensor:
        return self._sample(self._mean_and_candidates(observation)[0], deterministic)


def save_ppo_ranker(model: PPO, path: str | Path, summary: dict | None = None) -> Path:
    """``model.save`` to ``path`` plus the ``kvgym_ranker.json`` entry (atomically: a kill leaves the old file or
    the new one)."""
    meta = {"format": PPO_FORMAT, "version": RANKER_VERSION, "features": list(RANK_FEATURES),
            "hidden": model.policy.hidden, "summary": summary or {}}
    return save_sb3_zip(model, path, PPO_ENTRY, meta)


class GroupRelativeReward(VecEnvWrapper):
    """Each env's reward minus the mean reward of the other members of its group (the same decision, other
    sampled rankings): the leave-one-out baseline of ``python -m benchmarks.ranker_tools train``'s REINFORCE, inside PPO. The
    regret varies far more between decisions than between rankings of one decision, which a critic of the state
    has to learn; this baseline removes it exactly. ``info["regret"]`` keeps each ranking's own regret."""

    def __init__(self, venv, size: int):
        super().__init__(venv)
        self.size = size

    def reset(self):
        return self.venv.reset()

    def step_wait(self):
        observations, rewards, dones, infos = self.venv.step_wait()
        grouped = rewards.reshape(-1, self.size)
        baseline = (grouped.sum(axis=1, keepdims=True) - grouped) / (self.size - 1)
        return observations, (grouped - baseline).reshape(-1).astype(np.float32), dones, infos


def make_envs(decisions: Decisions, count: int, seed: int, group: int = 1):
    """``count`` replay envs for PPO, stepped as one batch (``RankingReplayVecEnv``); ``group`` > 1: consecutive
    groups of that many envs show one decision at a time and are rewarded against each other
    (``GroupRelativeReward``)."""
    envs = RankingReplayVecEnv(decisions, count, score_bound=SCORE_BOUND, group=group, seed=seed)
    return GroupRelativeReward(envs, group) if group > 1 else envs


class _Validation(BaseCallback):
    """Every ``every`` steps: the deterministic scorer's validation regret → logger, metrics, best files, last.zip."""

    def __init__(self, held: Decisions, out: Path, every: int, summary: dict, best: dict, log):
        super().__init__()
        self.held, self.out, self.every, self.summary, self.best, self.log = held, out, every, summary, best, log
        self.next_at = 0

    def evaluate(self) -> None:
        scorer = self.model.policy.scorer
        scorer.eval()
        with torch.no_grad():
            table = regret_table(self.held, scorer)["ranker"]
        scorer.train()
        steps = int(self.model.num_timesteps)
        row = {"timesteps": steps, "validation_regret": table["all"],
               "validation_regret_by": {k: v for k, v in table.items() if k != "all"},
               "log_std": float(self.model.policy.log_std.detach())}
        self.logger.record("ranker/validation_regret", table["all"])
        self.logger.record("ranker/log_std", row["log_std"])
        with (self.out / "metrics.jsonl").open("a") as metrics:
            metrics.write(json.dumps(row) + "\n")
        if table["all"] < self.best.get("regret", math.inf):
            self.best.update(regret=table["all"], timesteps=steps)
            summary = {**self.summary, "best": dict(self.best)}
            save_ranker(scorer, self.out / "ranker.pt", summary)
            save_ppo_ranker(self.model, self.out / "ppo.zip", summary)
        self.model.save(self.out / "last.zip")
        (self.out / "state.json").write_text(json.dumps({"best": self.best, "timesteps": steps}))
        self.log(f"{steps} steps: validation regret {table['all']:.4f} (best {self.best['regret']:.4f} at "
                 f"{self.best['timesteps']}), log std {row['log_std']:.3f}")
        self.next_at = steps + self.every

    def _on_training_start(self) -> None:
        self.next_at = int(self.model.num_timesteps) + (self.every if self.best else 0)
        if not self.best:
            self.evaluate()  # the start is a candidate too

    def _on_step(self) -> bool:
        if self.num_timesteps >= self.next_at:
            self.evaluate()
        return True


def train_ppo(records: list[dict], validation: list[dict], out: str | Path, timesteps: int = 500_000,
              start: str | Path | None = None, envs: int = 8, n_steps: int = 256, batch: int = 256,
              epochs: int = 4, lr: float = 1e-4, log_std_init: float = 0.0, eval_every: int = 50_000,
              learn_std: bool = True, hidden: int = 64, group: int = 1, seed: int = 0, resume: bool = False,
              log=print) -> dict:
    """PPO of a ``RankingPolicy`` on ``records`` (from ``start``'s weights, else from scratch with the training
    features' normalisation; ``group`` > 1: the group-relative reward of ``make_envs``); the best file by validation regret is ``out/ranker.pt`` and ``out/ppo.zip``; TensorBoard
    events, ``metrics.jsonl``, ``summary.json``. ``resume``: continue ``out/last.zip`` to ``timesteps`` in all."""
    if not 2 <= batch <= envs * n_steps:
        raise ValueError(f"batch: expected a minibatch of 2 to {envs * n_steps} rankings (envs {envs} x n_steps "
                         f"{n_steps} per rollout), got {batch}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data, held = Decisions(records), Decisions(validation)
    vec = make_envs(data, envs, seed, group)
    summary = {"train_rows": len(data), "validation_rows": len(held), "train_samples": len(records),
               "validation_samples": len(validation), "start": str(start) if start else "scratch",
               "timesteps": timesteps, "envs": envs, "n_steps": n_steps, "batch": batch, "epochs": epochs,
               "lr": lr, "log_std_init": log_std_init, "learn_std": learn_std, "group": group, "seed": seed}
    best: dict = {}
    if resume and (out / "last.zip").is_file():
        model = PPO.load(out / "last.zip", env=vec, custom_objects={"tensorboard_log": str(out / "tensorboard")})
        best = json.loads((out / "state.json").read_text())["best"]
        log(f"resuming {out / 'last.zip'} at {model.num_timesteps} steps")
    else:
        if resume:
            log(f"nothing to resume in {out} (no last.zip): starting")
        (out / "metrics.jsonl").write_text("")
        model = PPO(RankingPolicy, vec, learning_rate=lr, n_steps=n_steps, batch_size=batch, n_epochs=epochs,
                    gamma=0.0, gae_lambda=1.0, seed=seed, device="cpu", tensorboard_log=str(out / "tensorboard"),
                    policy_kwargs={"hidden": hidden, "log_std_init": log_std_init, "learn_std": learn_std})
        scorer = model.policy.scorer
        if start:
            scorer.load_state_dict(load_ranker(start)[0].state_dict())
        else:
            scorer.set_normalisation(data.features[data.candidates])
    remaining = timesteps - int(model.num_timesteps)
    if remaining > 0:
        model.learn(remaining, callback=_Validation(held, out, eval_every, summary, best, log),
                    tb_log_name="ppo", reset_num_timesteps=False)
    summary["best"] = best
    summary["validation"] = regret_table(held, None)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

