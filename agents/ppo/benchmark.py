"""``kvgym bench policy``: time per decision of a loaded policy (the controller's direct masked-argmax path),
side by side with SB3's ``predict`` on the same policy and observations, and the full ``decide`` on a live cache
view (observation encoding included)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _times_ms(fn, repeats: int) -> dict:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - start))
    return {"median_ms": statistics.median(samples), "mean_ms": statistics.fmean(samples),
            "p90_ms": float(np.percentile(samples, 90)), "repeats": repeats}


def fresh_policy_file(num_layers: int, num_candidates: int, folder: Path, hidden: int = 64) -> Path:
    """An untrained policy file for the given spaces (timing does not depend on the weights)."""
    import gymnasium as gym
    from sb3_contrib import MaskablePPO

    from agents.ppo.controller import save_policy
    from agents.ppo.policy import SlotScorerPolicy
    from kvgym.envs.observation import action_space, observation_space

    class SpacesOnly(gym.Env):  # MaskablePPO needs an env for its spaces; this one is never stepped
        def __init__(self):
            self.observation_space = observation_space(num_layers, num_candidates)
            self.action_space = action_space(num_candidates)

    agent = MaskablePPO(SlotScorerPolicy, SpacesOnly(), policy_kwargs={"hidden": hidden}, device="cpu", n_steps=64,
                        batch_size=64)
    return save_policy(agent, folder / "untrained.zip")


def bench_policy(path: str | Path | None, num_layers: int = 30, num_candidates: int = 32, repeats: int = 200,
                 model=None, seed: int = 0) -> dict:
    """Times per decision; ``path`` None benchmarks an untrained policy of ``num_layers`` × ``num_candidates``.
    With ``model``, also times ``decide`` on a real cache view after a 1024-token prefill."""
    from sb3_contrib import MaskablePPO

    from agents.ppo.controller import PPOController
    from kvgym.envs.observation import NUM_OPS, observation_space

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(path) if path else fresh_policy_file(num_layers, num_candidates, Path(tmp))
        controller = PPOController.load(file)
        agent = MaskablePPO.load(str(file), device="cpu")
        space = observation_space(controller.num_layers, controller.num_candidates)
        space.seed(seed)
        observation = {key: value.astype(np.float32) for key, value in space.sample().items()}
        for key in observation:
            observation[key] = np.clip(observation[key], 0.0, 2.0)
        rng = np.random.default_rng(seed)
        mask = rng.random((controller.num_candidates, NUM_OPS)) < 0.6
        mask[:, 0] = True
        report = {
            "policy": str(path) if path else "untrained",
            "num_layers": controller.num_layers, "num_candidates": controller.num_candidates,
            "torch_threads": torch.get_num_threads(),
            "direct_masked_argmax": _times_ms(lambda: controller.act(observation, mask), repeats),
            "sb3_predict": _times_ms(lambda: agent.predict({k: v[None] for k, v in observation.items()},
                                                           action_masks=mask.reshape(1, -1), deterministic=True),
                                     max(repeats // 4, 10)),
        }
        prepared = {key: value.numpy() for key, value in controller.prepare(observation).items()}
        sb3_action = agent.predict(prepared, action_masks=mask.reshape(1, -1), deterministic=True)[0][0]
        report["same_action_as_sb3"] = bool(np.array_equal(controller.act(observation, mask), sb3_action))
        if model is not None:
            report["decide_on_live_view"] = _decide_on_view(controller, model, repeats)
    report["target_ms"] = 1.0
    report["meets_target"] = report["direct_masked_argmax"]["median_ms"] <= 1.0
    return report


def _decide_on_view(controller, model, repeats: int) -> dict:
    from cache.controller import CacheView
    from cache.paged_cache import CacheConfig, PagedKVCache

    controller.check_fits(model.config.num_hidden_layers)
    cache = PagedKVCache(model.config, CacheConfig(max_tokens=1100))
    ids = torch.randint(0, model.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for start in range(0, 1024, 256):
            model(input_ids=ids[:, start : start + 256], cache=cache, use_cache=True, logits_to_keep=1)
    budget = [16] * cache.num_layers
    view = CacheView.from_cache(cache, budget)
    try:
        return {"view_ms": _times_ms(lambda: CacheView.from_cache(cache, budget), repeats),
                "decide_ms": _times_ms(lambda: controller.decide(view), repeats)}
    finally:
        cache.close()
