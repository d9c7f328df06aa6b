"""Baseline controllers, one file each; build them by name with ``agents.registry.make_controller``."""
