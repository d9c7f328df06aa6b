"""Benchmark (not a kvgym command): PPO's throughput on the ranking replay, DummyVecEnv of RankingReplayEnv (the
path before 2026-12-05) vs the batched RankingReplayVecEnv, side by side in one process, on synthetic decisions
of the real shape (30 layers × 128 blocks × 36 features; the regret and the policy do not depend on the values).

    OMP_NUM_THREADS=2 python benchmarks/ranker_ppo/bench_vecenv.py results/ranker_ppo/bench_vecenv.json
"""
import json
import sys
import time

import torch
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv

from agents.ranker.ppo import SCORE_BOUND, RankingPolicy, make_envs
from cache.ranking import RANK_FEATURES
from kvgym.envs.decisions import Decisions, RankingReplayEnv


def records(count: int, layers: int = 30, blocks: int = 128) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        features = torch.randn(layers, blocks, len(RANK_FEATURES), generator=generator)
        features[..., RANK_FEATURES.index("valid")] = 1.0
        out.append({"features": features.half(), "future_heads": torch.rand(layers, 3, blocks, generator=generator) ** 6,
                    "context_tokens": blocks * 16, "device_blocks": torch.full((layers,), blocks), "sink_blocks": 1,
                    "block_size": 16})
    return out


decisions = Decisions(records(20))
setups = {
    "DummyVecEnv x 8 (before)": lambda: DummyVecEnv([lambda: RankingReplayEnv(decisions, score_bound=SCORE_BOUND)
                                                     for _ in range(8)]),
    "RankingReplayVecEnv x 8": lambda: make_envs(decisions, 8, seed=0),
    "RankingReplayVecEnv x 8, group 8": lambda: make_envs(decisions, 8, seed=0, group=8),
    "RankingReplayVecEnv x 64 (n_steps 32)": lambda: make_envs(decisions, 64, seed=0),
    "RankingReplayVecEnv x 64 (n_steps 32), 1 epoch, batch 2048": lambda: make_envs(decisions, 64, seed=0),
}
UPDATES = {"RankingReplayVecEnv x 64 (n_steps 32), 1 epoch, batch 2048": {"n_epochs": 1, "batch_size": 2048}}
rows = []
for repeat in range(2):
    for name, make in setups.items():
        envs = make()
        n_steps = 2048 // envs.num_envs
        update = UPDATES.get(name, {"n_epochs": 4, "batch_size": 256})
        model = PPO(RankingPolicy, envs, n_steps=n_steps, gamma=0.0, seed=0, device="cpu", **update)
        model.learn(2048)  # warm-up rollout + update
        start = time.perf_counter()
        model.learn(8192, reset_num_timesteps=False)
        seconds = time.perf_counter() - start
        rows.append({"setup": name, "repeat": repeat, "steps": 8192, "seconds": seconds, "steps_per_s": 8192 / seconds})
        print(json.dumps(rows[-1]), flush=True)
report = {"threads": torch.get_num_threads(), "rows": rows, "decisions": len(decisions),
          "shape": list(decisions.features.shape[1:])}
json.dump(report, open(sys.argv[1], "w"), indent=2)
