"""Scripted replay policies (``agents/scripted.py``) are named with the controllers' one spec grammar."""

import numpy as np
import pytest

from agents.scripted import SCRIPTED, Evict, Fallback, Merge, Prefetch, Random, make_policy


def test_specs_build_policies_with_the_registry_grammar():
    assert make_policy("evict:mass,extra=2") == Evict("mass", 2)
    assert make_policy("merge:order=neighbour") == Merge("neighbour")
    assert make_policy("random:0.5") == Random(0.5)
    assert make_policy("prefetch") == Prefetch(0.0)
    assert make_policy("fallback") == Fallback()
    assert callable(make_policy("h2o:heavy_ratio=0.25,recent_ratio=0.25"))  # a controller, projected
    assert set(SCRIPTED) == {"fallback", "evict", "merge", "prefetch", "random"}


@pytest.mark.parametrize("spec, message", [
    ("evict:heaviest", "unknown order 'heaviest'"),
    ("evict:mass,bogus=1", "no parameter"),
    ("evict:mass,extra=x", "must be an integer"),
    ("random:often", "must be a finite number"),
    ("nope", "unknown policy 'nope'"),
    ("h2o:bogus=1", "no parameter"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        make_policy(spec)


def test_scripted_evictions_follow_the_order_within_each_layer_quota():
    from types import SimpleNamespace

    import torch

    from kvgym.envs.observation import BLOCK_FEATURES, Encoded

    # 4 slots: layer 0 twice, layer 1 twice; layer 0 is one block over budget, layer 1 is at its budget
    features = np.zeros((4, len(BLOCK_FEATURES)), np.float32)
    features[:, 3] = [0.5, 0.1, 0.2, 0.3]  # acc_mass column
    mask = np.ones((4, 4), bool)
    encoded = Encoded({"blocks": features.reshape(-1)}, mask, [(0, 5), (0, 6), (1, 5), (1, 6)])
    view = SimpleNamespace(device_blocks=lambda: torch.tensor([5, 4]), budget_blocks=torch.tensor([4, 4]))
    rng = np.random.default_rng(0)
    assert make_policy("evict:mass")(view, encoded, rng).tolist() == [0, 1, 0, 0]
    assert make_policy("merge:mass,extra=1")(view, encoded, rng).tolist() == [2, 2, 2, 0]
