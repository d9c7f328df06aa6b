"""The ranking action's exact reward from a trace: which blocks a ranking keeps (``kept_by_ranking``) and the future
attention it leaves off the device beyond what the future-attention oracle leaves (``ranking_regret``), for the
replay of decision points (``kvgym.envs.decisions``) and the ranker's training."""

from __future__ import annotations

import torch

from cache.ranking import top_b


def kept_by_ranking(scores, room, candidates) -> torch.Tensor:
    """``[..., N]`` bool: the top-``room`` ``scores`` among ``candidates``, what the ranking action keeps on device
    besides the pinned blocks (``cache.ranking.top_b``, the one top-b rule). ``scores`` ``[..., N]``, ``room``
    ``[...]`` ints, ``candidates`` ``[..., N]`` bool."""
    return top_b(scores, candidates, room)


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
