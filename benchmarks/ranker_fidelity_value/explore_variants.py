"""Exploration (not a kvgym command): which replay-regret variant ranks the fidelity policies as live KL does.

Reuses the live KL rows of a `python -m benchmarks.ranker_tools fidelity` JSON (the random policy's live side is rerun with its
fixed ranking), recomputes each sample's decision point and writes every policy's per-layer regrets under
several variants to variants_seed<SEED>.json; analyze_variants.py gives the Spearman per variant.

    python benchmarks/ranker_fidelity_value/explore_variants.py 7 2 results/ranker_fidelity_value/seed7.json
    python benchmarks/ranker_fidelity_value/analyze_variants.py results/ranker_fidelity_value/variants_seed7.json
"""
import gzip
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

from agents.ranker.model import load_ranker
from cache.models import load_model
from cache.paged_cache import CacheConfig
from cache.runner import Runner
from eval.harness import kl_divergence
from eval.ranking_fidelity import FEATURE_POLICIES, ScoredRanking, feature_score
from eval.tasks import generate
from eval.tasks.prompt import build_prompt
from kvgym.envs.decisions import Decisions, decision_point
from kvgym.envs.reward import ranking_regret

seed, n, src = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
live = {(r["sample"], r["budget"], r["policy"]): r["live_kl"] for r in json.loads(gzip.open(src).read() if str(src).endswith('.gz') else open(src).read())["rows"]}
ranker, _ = load_ranker("policies/ranker_smollm2.pt")
def fixed_random(features):
    return torch.rand(features.shape[:-1], generator=torch.Generator().manual_seed(0))
policies = {"ranker:policies/ranker_smollm2.pt": lambda f: ranker(f.float())[0],
            **{name: feature_score(c) for name, c in FEATURE_POLICIES.items()}, "random": fixed_random}
loaded = load_model("smollm2-135m")
tok = loaded.tokenizer
eos = {int(tok.eos_token_id)}
out = []
for task in ["passkey", "niah_single", "niah_multikey"]:
    for index in range(n):
        sample = generate(task, tok, 2048, seed=seed, index=index)
        prompt = build_prompt(tok, sample, True)
        runner = Runner(loaded.model, None, CacheConfig(block_size=16), protocol="oneshot-question")
        shared = runner.dense_prefill(prompt, min(sample.max_new_tokens, 24))
        record = decision_point(loaded.model, prompt, min(sample.max_new_tokens, 24), eos_ids=eos, shared=shared)
        answer = record["answer"].tolist()
        reference = None
        for budget in (0.125, 0.25):
            d = Decisions([record], budgets=(budget,))
            F = record["future_heads"].float()  # [L,H,N]
            for name, score in policies.items():
                s = score(d.features)
                key = (f"{task}/{index}", budget, name)
                if name == "random":
                    if reference is None:
                        reference = torch.stack(runner.run(prompt, forced_tokens=answer, keep_logits=True, shared=shared).logits)
                    r = Runner(loaded.model, None, CacheConfig(block_size=16), controller=ScoredRanking(score), budget=budget,
                               protocol="oneshot-question").run(prompt, forced_tokens=answer, keep_logits=True, shared=shared)
                    kl = float(kl_divergence(reference, torch.stack(r.logits)).mean())
                else:
                    kl = live[key]
                row = {"sample": key[0], "budget": budget, "policy": name, "live_kl": kl}
                # per-layer regrets of several mass definitions
                for agg in ("max", "mean"):
                    mass = F.amax(1) if agg == "max" else F.mean(1)
                    row[f"layer_{agg}"] = ranking_regret(s, mass, d.room, d.candidates).tolist()
                    # absolute: lost mass over the layer's whole mass (pinned included)
                    total_all = mass.clamp(min=0).sum(-1)
                    total_cand = torch.where(d.candidates, mass.clamp(min=0), 0).sum(-1)
                    row[f"layer_{agg}_abs"] = (ranking_regret(s, mass, d.room, d.candidates) * total_cand / total_all).tolist()
                # per head regret then mean over heads
                H = F.shape[1]
                per_head = torch.stack([ranking_regret(s, F[:, h], d.room, d.candidates) for h in range(H)], 1)  # [L,H]
                row["layer_headmean"] = per_head.mean(1).tolist()
                out.append(row)
        print(task, index, flush=True)
json.dump(out, open(f"results/ranker_fidelity_value/variants_seed{seed}.json", "w"))
