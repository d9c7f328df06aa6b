"""Controllers for the paged cache: baselines (``agents.baselines``) and, later, the PPO agent."""

from agents.registry import CONTROLLERS, make_controller

__all__ = ["CONTROLLERS", "make_controller"]
