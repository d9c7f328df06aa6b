"""Behaviour cloning of a scripted replay policy, to start PPO from a sensible policy.

PPO from scratch on this action space spends its first updates near the initial policy (mostly keep), where
the return's variance between episodes (trace and budget) drowns the effect of a single slot's op. Cloning a
teacher first (``merge:mass``: merge each over-budget layer's lowest-mass candidates instead of letting the
fallback evict them) gives PPO a starting point it then improves on (rl.md §2: Parrot and HALP start from
imitation too). The teacher is any ``agents.scripted.make_policy`` spec.
"""

from __future__ import annotations

import numpy as np
import torch


def collect(env, teacher: str, steps: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``steps`` (observation, mask, teacher action) triples from a replay env driven by the teacher."""
    from agents.scripted import make_policy, policy_inputs

    policy, rng = make_policy(teacher), np.random.default_rng(seed)
    observations, masks, actions = [], [], []
    observation, _ = env.reset(seed=seed)
    while len(actions) < steps:
        view, encoded = policy_inputs(env)
        action = np.asarray(policy(view, encoded, rng), np.int64)
        observations.append(observation)
        masks.append(encoded.mask.reshape(-1))
        actions.append(action)
        observation, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            observation, _ = env.reset()
    return {"observations": {key: np.stack([o[key] for o in observations]) for key in observations[0]},
            "masks": np.stack(masks), "actions": np.stack(actions)}


def clone(agent, vecnormalize, data: dict, epochs: int = 10, batch_size: int = 256, learning_rate: float = 1e-3,
          seed: int = 0) -> list[float]:
    """Fit ``agent``'s policy to the teacher's actions (masked log-likelihood). The VecNormalize observation
    statistics are first updated with the collected observations, so the policy is cloned on the inputs PPO
    will feed it. Returns the mean loss per epoch."""
    if vecnormalize is not None and vecnormalize.norm_obs:
        for key in vecnormalize.norm_obs_keys:
            vecnormalize.obs_rms[key].update(data["observations"][key])
        observations = vecnormalize.normalize_obs(data["observations"])
    else:
        observations = data["observations"]
    policy = agent.policy
    tensors = {key: torch.as_tensor(value, dtype=torch.float32) for key, value in observations.items()}
    masks = torch.as_tensor(data["masks"])
    actions = torch.as_tensor(data["actions"])
    optimiser = torch.optim.Adam(policy.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    policy.set_training_mode(True)
    for _ in range(epochs):
        order = torch.randperm(len(actions), generator=generator)
        total = 0.0
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            _, log_prob, _ = policy.evaluate_actions({k: v[index] for k, v in tensors.items()}, actions[index],
                                                     action_masks=masks[index].numpy())
            loss = -log_prob.mean() / actions.shape[1]  # per slot
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            total += float(loss.detach()) * len(index)
        losses.append(total / len(order))
    policy.set_training_mode(False)
    return losses
