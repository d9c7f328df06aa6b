"""The one reward function of the environments: the live env, the replay env and training's TensorBoard scalars
(``cache/reward_*``, which log the ``info["reward_terms"]`` the envs computed here) all use it.

Per step, in nats and MB:

``reward = -(kl + mass_scale × lost_mass) - lambda_bytes × MB moved + lambda_task × task_score``

- ``kl``: the live env's KL to the full cache's next-token distributions (teacher-forced on the reference's tokens),
  or the replay env's proxy for it (``kl_scale × kl_proxy``), summed over the step's scored forwards;
- ``lost_mass``: the replay env's future attention mass on blocks off the device (0 live);
- ``bytes_moved``: bytes moved between tiers in the step's operations (including the budget fallback's);
- ``task_score``: the task score of the answer, on the episode's last step (0 in replay: no answer is decoded).
"""

from __future__ import annotations

import torch

REWARD_TERMS = ("kl", "mass", "bytes", "task")


def reward_terms(kl: float, bytes_moved: float, task_score: float = 0.0, lost_mass: float = 0.0, *,
                 lambda_bytes: float, lambda_task: float = 1.0, mass_scale: float = 0.0) -> dict[str, float]:
    """The signed terms of one step's reward, keyed by ``REWARD_TERMS``; their sum is ``reward``."""
    return {"kl": -kl, "mass": -mass_scale * lost_mass, "bytes": -lambda_bytes * bytes_moved / 2**20,
            "task": lambda_task * task_score}


def reward(terms: dict[str, float]) -> float:
    """The step's reward: the sum of its ``reward_terms``."""
    return float(sum(terms[name] for name in REWARD_TERMS))


def kept_by_ranking(scores, room, candidates) -> torch.Tensor:
    """``[..., N]`` bool: the top-``room`` ``scores`` among ``candidates``, what the ranking action keeps on device
    besides the pinned blocks (ties keep block order; non-candidates never kept). ``scores`` ``[..., N]``, ``room``
    ``[...]`` ints, ``candidates`` ``[..., N]`` bool."""
    order = torch.sort(torch.where(candidates, scores.float(), torch.tensor(-torch.inf)), dim=-1, descending=True,
                       stable=True).indices
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    return candidates & (ranks < torch.as_tensor(room)[..., None])


def ranking_regret(scores, future_mass, room, candidates):
    """The regret of keeping the top-``room`` ``scores`` among ``candidates`` (the ranking action,
    ``cache.ranking``; ``kept_by_ranking``), exact from a trace: the future attention mass of the candidates
    left off the device, **minus what the future-attention oracle (keeping the ``room`` candidates of largest
    future mass) leaves off from the same state**, divided by the candidates' total future mass, so samples and
    budgets compare (0 = the oracle's choice, 1 = everything lost). Batched: ``scores``, ``future_mass``
    ``[..., N]`` torch tensors, ``room`` ``[...]`` ints (blocks to keep besides the pinned ones), ``candidates``
    ``[..., N]`` bool; returns ``[...]``."""
    mass = torch.where(candidates, future_mass.float().clamp(min=0), torch.zeros(()))
    total = mass.sum(dim=-1)

    def kept(values: torch.Tensor) -> torch.Tensor:
        return torch.where(kept_by_ranking(values, room, candidates), mass, 0.0).sum(dim=-1)

    return ((kept(future_mass) - kept(scores)) / total.clamp(min=1e-12)).clamp(min=0.0)  # >= 0 up to rounding
