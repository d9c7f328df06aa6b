"""Several runs driven together through batched forwards (``cache.driving.run_batched``) give each run what it gives
alone (``Runner.run``): the same tokens, operations and bytes, logits equal to float rounding, in every protocol;
a run made different on purpose (another budget) is told apart (negative control)."""

import pytest
import torch

from agents.registry import make_controller
from cache.driving import run_batched
from cache.paged_cache import CacheConfig
from cache.runner import Prompt, Runner

GENERATOR = torch.Generator().manual_seed(11)
CONTEXT = torch.randint(2, 250, (180,), generator=GENERATOR).tolist()
QUESTION = torch.randint(2, 250, (12,), generator=GENERATOR).tolist()
TURNS = [torch.randint(2, 250, (7,), generator=GENERATOR).tolist() for _ in range(2)]
SPECS = [("full", None), ("tova", 0.25), ("knorm", 0.25), ("snapkv", 0.125), ("h2o", 0.5), ("streamingllm", 0.25)]


def runners(model, protocol):
    config = CacheConfig(host_blocks=16)
    return [Runner(model, None, config, controller=make_controller(spec), budget=budget, prefill_chunk=32,
                   decide_every=4, protocol=protocol) for spec, budget in SPECS]


def same_run(a, b) -> bool:
    return (a.turn_tokens == b.turn_tokens and a.operations == b.operations and a.bytes_moved == b.bytes_moved
            and a.fallbacks == b.fallbacks and len(a.logits) == len(b.logits)
            and all(torch.allclose(x, y, atol=1e-4) for x, y in zip(a.logits, b.logits, strict=True)))


@pytest.mark.parametrize("protocol", ["streaming", "oneshot-question", "oneshot", "multiturn"])
def test_batched_runs_equal_runs_alone(tiny_model, protocol, monkeypatch):
    import cache.batched

    rows = []
    real = cache.batched.batched_forward
    monkeypatch.setattr(cache.batched, "batched_forward",
                        lambda model, caches, ids: rows.append(len(caches)) or real(model, caches, ids))
    prompt = Prompt(CONTEXT + QUESTION, context_end=len(CONTEXT), turns=TURNS if protocol == "multiturn" else [])
    options = {"max_new_tokens": 10, "keep_logits": True, "stop_at_eos": False}
    alone = [runner.run(prompt, **options) for runner in runners(tiny_model, protocol)]
    if protocol.startswith("oneshot"):  # one shared dense prefill, as the harness runs them
        shared = Runner(tiny_model, None, CacheConfig(), protocol=protocol).dense_prefill(prompt, 10)
        options["shared"] = shared
    together = run_batched([runner.steps(prompt, **options) for runner in runners(tiny_model, protocol)])
    for (spec, budget), a, b in zip(SPECS, alone, together, strict=True):
        assert same_run(a, b), (protocol, spec, budget)
    assert sum(sum(r.operations.values()) for r in alone) > 0  # the runs made decisions
    assert not same_run(alone[1], together[2])  # negative control: another controller's run differs
    assert rows and max(rows) == len(SPECS)  # the forwards were batched, all runs in one


def test_teacher_forced_runs_batch_too(tiny_model):
    prompt = Prompt(CONTEXT)
    forced = torch.randint(2, 250, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    options = {"keep_logits": True, "forced_tokens": forced}
    alone = [runner.run(prompt, **options) for runner in runners(tiny_model, "streaming")]
    together = run_batched([runner.steps(prompt, **options) for runner in runners(tiny_model, "streaming")])
    assert all(same_run(a, b) for a, b in zip(alone, together, strict=True))
    assert all(len(r.logits) == len(forced) for r in together)


def test_a_bad_run_stops_the_batch_and_names_its_position(tiny_model):
    good, bad = runners(tiny_model, "streaming")[1:3]
    with pytest.raises(ValueError, match="forced_tokens") as caught:
        run_batched([good.steps(Prompt(CONTEXT)), bad.steps(Prompt(CONTEXT), forced_tokens=[])])
    assert caught.value.run_index == 1


def test_decisions_run_without_autograd_in_every_driver(tiny_model):
    """A controller's own forwards (KVzip's reconstruction) must not build graphs: the drivers resume a run's
    generator under ``no_grad``, its first step (a one-shot compression, before any forward is asked) included."""
    from cache.driving import drive

    seen = []

    class Probe:
        def decide(self, view):
            seen.append(torch.is_grad_enabled())
            return []

    prompt = Prompt(CONTEXT + QUESTION, context_end=len(CONTEXT))
    shared = Runner(tiny_model, None, CacheConfig(), protocol="oneshot-question").dense_prefill(prompt, 4)

    def steps():
        runner = Runner(tiny_model, None, CacheConfig(), controller=Probe(), budget=0.5, protocol="oneshot-question")
        return runner.steps(prompt, 4, shared=shared)

    run_batched([steps(), steps()])
    drive(steps())
    assert seen and not any(seen)
