"""Can RL earn its place on bytes moved (issue 39)? A learned, state-dependent hysteresis for the shipped ranker,
trained with PPO on the replay twin, against every fixed hysteresis.

The shipped ranker ranks every block; ``stay`` (``keep_top``'s hysteresis) trades the attention it keeps for the
bytes it moves, and is set by hand (2). Which trade is best depends on the moment: mid-prefill, moving a block
buys little; at the question, the block to bring back may be the answer. The oracle cannot teach this choice
(its top-b ignores transfer cost and later states), so it is a decision for RL on the sequential reward.

- Env (``StayEnv``): each step of ``kvgym/KVCacheReplay-v1`` (recorded full-cache episodes of 2k-token streaming
  samples, a host tier of 512 blocks) the agent picks ``stay`` from ``STAYS`` (``Discrete``); the ranker's scores,
  lifted by that hysteresis, decide the step. Reward: the replay's, minus the attention share lost off the device
  until the next decision point, minus ``cost`` per MB moved. Observation: the phase, whether the question was
  read, progress, budget, MB moved so far, mean layer pressure, and for each ``stay`` of ``STAYS`` the share of
  host blocks it would bring back (how much reshuffling the ranker wants now).
- PPO (SB3, ``MlpPolicy``) on the training episodes, budgets drawn from 0.125..0.25; the checkpoint is picked on
  the validation episodes; every fixed ``stay`` and the question-free variant (``stay`` 2, 0 at the question)
  are scored on the same validation episodes, and the best fixed one is chosen there.
- Report: held-out-family episodes (never trained on, never used to choose), budgets 0.125 and 0.25: return,
  attention lost per step, MB moved per step, per policy, and the paired difference of the learned policy from
  the best fixed one (bootstrap over episodes).

    python -m benchmarks.rl_stay.experiment --data data/replay_stay --cost 0.02 --json results/rl_stay/cost0.02.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from benchmarks.replay_fidelity_v1 import rank_action, ranker, with_stay
from cache.controller import PHASES
from cache.ranking import RANK_FEATURES

STAYS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
TIER_DEVICE = RANK_FEATURES.index("tier_device")


class StayEnv(gym.Env):
    """See the module docstring."""

    def __init__(self, folder, cost: float, budget_range=(0.125, 0.25), host_blocks: int = 512,
                 policy: str = "policies/ranker_smollm2.pt"):
        from kvgym.envs.kvcache_replay import KVCacheReplayEnv

        self.replay = KVCacheReplayEnv(str(folder), budget_range=budget_range, host_blocks=host_blocks,
                                       transfer_cost=cost)
        self.score = ranker(policy)
        self.action_space = spaces.Discrete(len(STAYS))
        self.observation_space = spaces.Box(-np.inf, np.inf, (len(PHASES) + 5 + len(STAYS),), np.float32)
        self._last = None

    def _features(self, observation) -> np.ndarray:
        glob = observation["globals"]  # phase one-hot, question read, progress, budget, MB moved so far
        keep = self._keep = self.score(observation["blocks"], observation["mask"])  # step() acts on these scores
        valid = observation["mask"] > 0
        device = observation["blocks"][..., TIER_DEVICE] > 0
        host = valid & ~device
        wanted = []
        for stay in STAYS:  # share of host blocks this hysteresis would bring back (each layer's top-b by score)
            lifted = np.where(valid, with_stay(keep, observation["blocks"], observation["mask"], stay), -np.inf)
            room = device.sum(axis=1, keepdims=True)
            threshold = -np.sort(-lifted, axis=1)[np.arange(lifted.shape[0])[:, None], np.maximum(room - 1, 0)]
            wanted.append(float((host & (lifted >= threshold)).sum() / max(host.sum(), 1)))
        pressure = float(observation["layers"][:, 0].mean())
        return np.array([*glob[:-1], glob[-1] / 100.0, pressure, *wanted], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        observation, info = self.replay.reset(seed=seed, options=options)
        self._last = observation
        return self._features(observation), info

    def step(self, action):
        stay = STAYS[int(action)]
        observation = self._last
        keep = with_stay(self._keep, observation["blocks"], observation["mask"], stay)
        observation, reward, done, truncated, info = self.replay.step(rank_action(keep, observation["mask"]))
        self._last = observation
        info = {**info, "stay": stay}
        return self._features(observation), reward, done, truncated, info


def play(env: StayEnv, choose, episode: int, budget: float) -> dict:
    features, _ = env.reset(options={"episode": episode, "budget": budget})
    total = lost = mb = 0.0
    steps, done = 0, False
    while not done:
        features, reward, done, _, info = env.step(choose(features, env))
        total, lost, mb, steps = total + reward, lost + info["lost_mass"], mb + info["mb_moved"], steps + 1
    return {"return": total, "lost_per_step": lost / steps, "mb_per_step": mb / steps, "steps": steps}


def fixed(stay: float):
    index = STAYS.index(stay)
    return lambda features, env: index


def question_free(features, env):
    """stay 2, but 0 at the question's decision point (the ranker's ``question_stay=0``)."""
    at_question = features[PHASES.index("question")] > 0.5
    return STAYS.index(0.0) if at_question else STAYS.index(2.0)


def score_policies(env: StayEnv, policies: dict, budgets) -> dict:
    return {name: {budget: [play(env, choose, e, budget) for e in range(len(env.replay.episodes))]
                   for budget in budgets} for name, choose in policies.items()}


def mean_return(runs: dict) -> float:
    return float(np.mean([r["return"] for rows in runs.values() for r in rows]))


def paired(a: list[dict], b: list[dict], boot: int = 4000) -> tuple[float, float, float]:
    diffs = [x["return"] - y["return"] for x, y in zip(a, b, strict=True)]
    rng = random.Random(0)
    means = sorted(float(np.mean(rng.choices(diffs, k=len(diffs)))) for _ in range(boot))
    return float(np.mean(diffs)), means[int(0.025 * boot)], means[int(0.975 * boot) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("data/replay_stay"))
    parser.add_argument("--cost", type=float, default=0.02, help="reward per MB moved between tiers")
    parser.add_argument("--timesteps", type=int, default=60_000)
    parser.add_argument("--eval-every", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    budgets = (0.125, 0.25)
    train = make_vec_env(lambda: StayEnv(args.data / "train", args.cost), n_envs=4, seed=args.seed)
    validation = StayEnv(args.data / "validation", args.cost)
    heldout = StayEnv(args.data / "heldout", args.cost)
    model = PPO("MlpPolicy", train, n_steps=256, batch_size=256, n_epochs=4, learning_rate=3e-4, gamma=0.99,
                ent_coef=0.01, seed=args.seed, device="cpu", verbose=0)

    def learned(features, env, model=model):
        return int(model.predict(features, deterministic=True)[0])

    baselines = {f"stay {s:g}": fixed(s) for s in STAYS}
    baselines["stay 2, question 0"] = question_free
    chosen = score_policies(validation, baselines, budgets)
    best_fixed = max(chosen, key=lambda name: mean_return(chosen[name]))
    curve, best = [], {"return": -np.inf}
    while model.num_timesteps < args.timesteps:
        model.learn(args.eval_every, reset_num_timesteps=False)
        value = mean_return(score_policies(validation, {"ppo": learned}, budgets)["ppo"])
        curve.append({"timesteps": model.num_timesteps, "validation_return": value})
        print(json.dumps(curve[-1]), flush=True)
        if value > best["return"]:
            best = {"return": value, "timesteps": model.num_timesteps}
            model.save(args.json.with_suffix(".zip"))
    model = PPO.load(args.json.with_suffix(".zip"), device="cpu")
    report_policies = {**baselines, "ppo": lambda features, env: int(model.predict(features, deterministic=True)[0])}
    scored = score_policies(heldout, report_policies, budgets)
    table = {}
    for name, runs in scored.items():
        table[name] = {str(b): {key: float(np.mean([r[key] for r in rows])) for key in ("return", "lost_per_step", "mb_per_step")}
                       for b, rows in runs.items()}
    differences = {str(b): paired(scored["ppo"][b], scored[best_fixed][b]) for b in budgets}
    stays_used = {}
    for b in budgets:  # which hysteresis the learned policy picks, by phase, on the held-out episodes
        counts: dict = {}
        for e in range(len(heldout.replay.episodes)):
            features, _ = heldout.reset(options={"episode": e, "budget": b})
            done = False
            while not done:
                phase = PHASES[int(np.argmax(features[: len(PHASES)]))]
                action = report_policies["ppo"](features, heldout)
                counts.setdefault(phase, {}).setdefault(str(STAYS[action]), 0)
                counts[phase][str(STAYS[action])] += 1
                features, _, done, _, _ = heldout.step(action)
        stays_used[str(b)] = counts
    report = {"cost_per_mb": args.cost, "timesteps": args.timesteps, "seed": args.seed, "best": best,
              "curve": curve, "best_fixed_on_validation": best_fixed,
              "validation_returns": {name: mean_return(runs) for name, runs in chosen.items()},
              "heldout": table, "ppo_minus_best_fixed": differences, "ppo_stays_by_phase": stays_used,
              "episodes": {name: len(env.replay.episodes) for name, env in
                           (("validation", validation), ("heldout", heldout))}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("curve",)}, indent=1))


if __name__ == "__main__":
    main()
