"""The weight-shared per-slot scorer, in plain torch (no SB3): the training policy wraps these modules, and a
loaded policy runs them directly.

The observation (``kvgym.envs.observation``) is flattened in ``OBSERVATION_KEYS`` order. Every candidate slot
is scored by the same small MLP from its own features, the pressure of its layer and a global context (progress,
budget, bytes moved, tier occupancy, mean and max layer pressure), so one set of weights serves every slot, any
``K`` and any permutation of the candidates (Parrot's per-line scorer, GridNet's shared per-cell head). The
critic pools the slot embeddings (mean and max over valid slots) with the context.
"""

from __future__ import annotations

import torch
from torch import nn

from cache.controller import Op
from kvgym.envs.observation import BLOCK_FEATURES, GLOBAL_FEATURES, NUM_OPS

OBSERVATION_KEYS = ("layer_pressure", "tier_occupancy", "blocks", "globals")
VALID = BLOCK_FEATURES.index("valid")
LAYER_DEPTH = BLOCK_FEATURES.index("layer_depth")
CONTEXT_SIZE = len(GLOBAL_FEATURES) + 3 + 2  # globals, tier occupancy, mean and max layer pressure


def observation_sizes(num_layers: int, num_candidates: int) -> dict[str, int]:
    """The flattened size of each part of the slot env's observation."""
    return {"layer_pressure": num_layers, "tier_occupancy": 3, "blocks": num_candidates * len(BLOCK_FEATURES),
            "globals": len(GLOBAL_FEATURES)}


def flatten_observation(observation: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, D]``: the observation's boxes concatenated in ``OBSERVATION_KEYS`` order."""
    return torch.cat([observation[key].flatten(1).float() for key in OBSERVATION_KEYS], dim=1)


class SlotNetwork(nn.Module):
    """Per-slot encoder (actor latent ``[B, K * hidden]``) and pooled critic latent ``[B, hidden]`` from the flat
    observation. Has SB3's ``MlpExtractor`` interface (``forward``, ``forward_actor``, ``forward_critic``,
    ``latent_dim_pi``, ``latent_dim_vf``)."""

    def __init__(self, num_layers: int, num_candidates: int, hidden: int = 64):
        super().__init__()
        self.num_layers, self.num_candidates, self.hidden = num_layers, num_candidates, hidden
        sizes = observation_sizes(num_layers, num_candidates)
        self.split = [sizes[key] for key in OBSERVATION_KEYS]
        slot_in = len(BLOCK_FEATURES) + 1 + CONTEXT_SIZE
        self.slot_encoder = nn.Sequential(nn.Linear(slot_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.critic = nn.Sequential(nn.Linear(2 * hidden + CONTEXT_SIZE, hidden), nn.Tanh())
        self.latent_dim_pi = num_candidates * hidden
        self.latent_dim_vf = hidden

    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot embeddings ``[B, K, H]``, the valid-slot mask ``[B, K]`` and the context ``[B, C]``."""
        pressure, occupancy, blocks, globals_ = torch.split(flat, self.split, dim=1)
        blocks = blocks.reshape(flat.shape[0], self.num_candidates, len(BLOCK_FEATURES))
        context = torch.cat([globals_, occupancy, pressure.mean(1, keepdim=True), pressure.amax(1, keepdim=True)], 1)
        layer = (blocks[..., LAYER_DEPTH] * max(self.num_layers - 1, 1)).round().long().clamp(0, self.num_layers - 1)
        slot_pressure = torch.gather(pressure, 1, layer).unsqueeze(-1)
        slot_input = torch.cat([blocks, slot_pressure, context.unsqueeze(1).expand(-1, self.num_candidates, -1)], -1)
        return self.slot_encoder(slot_input), blocks[..., VALID] > 0.5, context

    def forward_actor(self, flat: torch.Tensor) -> torch.Tensor:
        return self.encode(flat)[0].flatten(1)

    def forward_critic(self, flat: torch.Tensor) -> torch.Tensor:
        slots, valid, context = self.encode(flat)
        weight = valid.unsqueeze(-1).float()
        mean = (slots * weight).sum(1) / weight.sum(1).clamp(min=1.0)
        peak = slots.masked_fill(~valid.unsqueeze(-1), -1.0).amax(1)  # tanh outputs lie in [-1, 1]
        return self.critic(torch.cat([mean, peak, context], dim=1))

    def forward(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_actor(flat), self.forward_critic(flat)


class SlotOpHead(nn.Module):
    """One ``Linear(hidden, 4)`` shared by every slot: ``[B, K * hidden]`` → op logits ``[B, K * 4]`` (slot-major,
    the layout of ``MultiDiscrete([4] * K)``). ``keep_bias`` starts the policy mostly keeping, so an untrained
    policy does not evict a third of its candidates at random."""

    def __init__(self, hidden: int = 64, keep_bias: float = 2.0):
        super().__init__()
        self.hidden = hidden
        self.linear = nn.Linear(hidden, NUM_OPS)
        nn.init.orthogonal_(self.linear.weight, gain=0.01)
        with torch.no_grad():
            self.linear.bias.zero_()
            self.linear.bias[int(Op.KEEP)] = keep_bias

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.linear(latent.reshape(latent.shape[0], -1, self.hidden)).flatten(1)


def masked_argmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, K * 4]`` logits and bool mask → ``[B, K]`` ops, the best legal op per slot."""
    batch = logits.shape[0]
    scores = logits.reshape(batch, -1, NUM_OPS).masked_fill(~mask.reshape(batch, -1, NUM_OPS), float("-inf"))
    return scores.argmax(-1)
