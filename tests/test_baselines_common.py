"""Properties every registered controller must have, on the tiny model: the budget is met by the controller's
own decisions at every decision point (no fallback evictions), and only legal operations are requested."""

import pytest
import torch

from agents.registry import BASELINES, make_controller, parse_spec
from cache.controller import CacheView, Op
from cache.paged_cache import CacheConfig
from cache.runner import Prompt, Runner


class Checked:
    """Wraps a controller: checks each decision list is legal and brings every layer (or, under a global budget,
    all layers together) within budget; a decision for one KV head counts that head's share of the block."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0
        self.full_cache = getattr(inner, "full_cache", False)
        self.budget_scope = getattr(inner, "budget_scope", None)  # the runner asks the controller
        if hasattr(inner, "layer_budgets"):  # the runner splits the budget with the controller's own schedule
            self.layer_budgets = inner.layer_budgets

    def decide(self, view: CacheView):
        decisions = self.inner.decide(view)
        self.calls += 1
        cache = view.cache
        device = torch.tensor([cache.device_load(layer) for layer in range(view.num_layers)], dtype=torch.float64)
        legal = view.legal_ops
        seen = set()
        for decision in decisions:
            key = (decision.layer, decision.block, decision.head)
            assert key not in seen and (decision.layer, decision.block, -1) not in seen, f"two decisions for {key}"
            seen.add(key)
            assert legal[decision.layer, decision.block, decision.op], f"illegal {decision}"
            share = 1.0 / cache.num_kv_heads if decision.head >= 0 else 1.0
            if decision.op in (Op.EVICT, Op.MERGE):
                device[decision.layer] -= share
            elif decision.op == Op.PREFETCH:
                device[decision.layer] += 1
        if view.total_budget is not None:
            assert device.sum() <= view.total_budget + 1e-6, f"over budget: {device.sum()} > {view.total_budget}"
        else:
            assert torch.all(device <= view.budget_blocks + 1e-6), f"over budget: {device} > {view.budget_blocks}"
        return decisions


@pytest.mark.parametrize("name", BASELINES)
def test_controller_meets_the_budget_itself_at_every_decision(tiny_model, name):
    controller = Checked(make_controller(name))
    runner = Runner(tiny_model, controller=controller, budget=5, prefill_chunk=32, decide_every=3,
                    cache_config=CacheConfig(host_blocks=64))
    result = runner.run(torch.randint(2, 256, (1, 200), generator=torch.Generator().manual_seed(0)),
                        max_new_tokens=24, stop_at_eos=False)
    if controller.full_cache:
        assert result.budget_blocks is None and controller.calls == 0
        assert result.blocks_per_tier["device"] == [-(-223 // 16)] * 2
        return
    assert controller.calls > 0
    assert result.fallbacks == 0
    assert sum(result.budget_blocks) <= 10  # a controller's own split (pyramidkv, spindlekv) spends the same total
    assert all(device <= budget for device, budget in zip(result.blocks_per_tier["device"], result.budget_blocks,
                                                          strict=True))


@pytest.mark.parametrize("protocol", ["oneshot", "oneshot-question"])
@pytest.mark.parametrize("name", BASELINES)
def test_controller_meets_the_budget_in_the_one_shot_protocols(tiny_model, name, protocol):
    """The compress decision (kvzip's reconstruction and expected_attention's prompt statistics included), then a
    fixed budget while the question and the answer run."""
    inner = make_controller(name)
    if getattr(inner, "full_cache", False):
        pytest.skip("the full cache makes no decisions")
    if protocol not in getattr(inner, "protocols", (protocol,)):
        pytest.skip(f"{name} does not run {protocol}")
    controller = Checked(inner)
    runner = Runner(tiny_model, controller=controller, budget=0.25, prefill_chunk=32, decide_every=3,
                    cache_config=CacheConfig(host_blocks=64), protocol=protocol, decode_budget="fixed")
    ids = torch.randint(2, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    result = runner.run(Prompt(ids, context_end=170), max_new_tokens=20, stop_at_eos=False)
    assert controller.calls > 0 and result.fallbacks == 0
    assert all(device <= budget for device, budget in zip(result.blocks_per_tier["device"], result.budget_blocks,
                                                          strict=True))


def test_spec_parsing_and_errors():
    assert parse_spec("StreamingLLM:n_sink=32") == ("streamingllm", {"n_sink": 32})
    assert make_controller("streamingllm:n_sink=32").n_sink == 32
    assert make_controller("streamingllm").n_sink == 4  # from configs/controllers/streamingllm.yaml
    with pytest.raises(ValueError, match="unknown controller 'h3o'"):
        make_controller("h3o")
    with pytest.raises(ValueError, match="has no parameter"):
        make_controller("streamingllm:window=3")
    with pytest.raises(ValueError, match="expected key=value"):
        make_controller("streamingllm:32")
