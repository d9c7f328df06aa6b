"""Integration: every baseline on SmolLM2 passkey retrieval at ~2k tokens and budget 0.5.

Accuracy is reported (printed, and written to ``$KVGYM_REPORT_DIR/baselines_passkey_2k.json`` when that
variable is set); the only fixed expectation is that the full cache succeeds.
"""

import json
import os
from pathlib import Path

import pytest

from agents.registry import BASELINES, make_controller
from cache.paged_cache import CacheConfig
from cache.runner import Runner
from eval.tasks.passkey import passkey_sample, score_passkey

pytestmark = pytest.mark.integration

SEEDS = [0]
BUDGET = 0.5


def build_controller(name, smollm2, ids, max_new_tokens):
    if name == "oracle":
        from agents.baselines.oracle import Oracle

        return Oracle.from_run(smollm2.model, ids, max_new_tokens=max_new_tokens, prefill_chunk=64)
    return make_controller(name)


def test_every_baseline_on_passkey_2k(smollm2):
    tokenizer = smollm2.tokenizer
    report = {}
    for name in BASELINES:
        correct = []
        for seed in SEEDS:
            sample = passkey_sample(tokenizer, 2000, seed=seed, depth=0.5)
            ids = tokenizer(sample.prompt).input_ids
            controller = build_controller(name, smollm2, ids, 8)
            runner = Runner(smollm2.model, tokenizer, CacheConfig(host_blocks=256), controller=controller,
                            budget=BUDGET, prefill_chunk=64, decide_every=1)
            result = runner.run(ids, max_new_tokens=8, stop_at_eos=False)
            correct.append(score_passkey(result.text, sample.answer))
            assert result.fallbacks == 0 or name == "full", f"{name} needed {result.fallbacks} fallback evictions"
        report[name] = {"accuracy": sum(correct) / len(correct), "n": len(correct)}
    print(json.dumps(report, indent=1))
    if os.environ.get("KVGYM_REPORT_DIR"):
        path = Path(os.environ["KVGYM_REPORT_DIR"]) / "baselines_passkey_2k.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"budget": BUDGET, "length": 2000, "seeds": SEEDS, "results": report}, indent=1))
    assert report["full"]["accuracy"] == 1.0
