"""MaskablePPO's policy for kvgym: SB3 plumbing around the plain-torch slot scorer (``agents.ppo.network``)."""

from __future__ import annotations

import torch
from gymnasium import spaces
from sb3_contrib.common.maskable.policies import MaskableMultiInputActorCriticPolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

from agents.ppo.network import OBSERVATION_KEYS, SlotNetwork, SlotOpHead, flatten_observation
from kvgym.envs.observation import BLOCK_FEATURES


def observation_layout(observation_space: spaces.Dict) -> tuple[int, int]:
    """``(num_layers, num_candidates)`` of a kvgym observation space; a clear error for any other space."""
    if not isinstance(observation_space, spaces.Dict) or set(observation_space.spaces) != set(OBSERVATION_KEYS):
        raise ValueError(f"observation space {observation_space}: expected kvgym's Dict with keys {OBSERVATION_KEYS}")
    num_layers = observation_space["layer_pressure"].shape[0]
    width = observation_space["blocks"].shape[0]
    if width % len(BLOCK_FEATURES):
        raise ValueError(f"observation space: 'blocks' has {width} values, not a multiple of {len(BLOCK_FEATURES)}")
    return num_layers, width // len(BLOCK_FEATURES)


class ConcatObservation(BaseFeaturesExtractor):
    """No parameters: the Dict observation flattened in a fixed key order (the slot network does the work)."""

    def __init__(self, observation_space: spaces.Dict):
        size = sum(int(observation_space[key].shape[0]) for key in OBSERVATION_KEYS)
        super().__init__(observation_space, features_dim=size)

    def forward(self, observations: dict[str, torch.Tensor]) -> torch.Tensor:
        return flatten_observation(observations)


class SlotScorerPolicy(MaskableMultiInputActorCriticPolicy):
    """``MultiDiscrete([4] * K)`` actor-critic whose actor is one scorer shared by every candidate slot
    (``hidden`` units) and whose critic pools the slots. ``keep_bias`` is the initial keep logit."""

    def __init__(self, observation_space, action_space, lr_schedule, hidden: int = 64, keep_bias: float = 2.0,
                 **kwargs):
        self.hidden, self.keep_bias = hidden, keep_bias
        self.num_layers, self.num_candidates = observation_layout(observation_space)
        kwargs.setdefault("features_extractor_class", ConcatObservation)
        kwargs.setdefault("net_arch", [])
        super().__init__(observation_space, action_space, lr_schedule, **kwargs)

    def _build_mlp_extractor(self) -> None:
        self.mlp_extractor = SlotNetwork(self.num_layers, self.num_candidates, self.hidden)

    def _build(self, lr_schedule) -> None:
        super()._build(lr_schedule)
        self.action_net = SlotOpHead(self.hidden, self.keep_bias)  # replaces SB3's dense K*H -> K*4 layer
        # _build made the optimizer over the replaced head's parameters; make it again over the real ones
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

    def _get_constructor_parameters(self) -> dict:
        return {**super()._get_constructor_parameters(), "hidden": self.hidden, "keep_bias": self.keep_bias}
