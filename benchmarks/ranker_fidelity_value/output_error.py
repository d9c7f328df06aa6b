"""Exploration (not a kvgym command): does a replay target that sees the attention *output* rank the fidelity
policies as live KL does?

For every sample of a `python -m benchmarks.ranker_tools fidelity` JSON (same seed, n, tasks, budgets, policies) this recomputes the
decision point and, in one full-cache forward of the teacher-forced answer, captures each layer's queries, keys
and values (the queries are the full cache's: each layer is scored in isolation, nothing propagates). For every
policy's per-layer kept blocks (the same top-b as the replay regret and LiveDecision) it computes, per layer, the
answer queries' attention output without the dropped blocks, and scores

- ``out_rel``: Σ‖o' − o‖² / Σ‖o‖² over heads and answer queries (the attention output's relative error),
- ``proj_rel``: the same after the layer's ``o_proj`` (what the layer adds to the residual stream),
- ``proj_abs``: Σ‖W_o(o' − o)‖² over answer queries, not normalised (later layers weigh by their own scale),
- ``lost``: the attention mass of the dropped blocks, max over query heads, summed over answer queries,
  normalised by the layer's context mass (a per-layer lost mass like the regret's, without the oracle),
- ``contrib`` / ``contrib_max``: additive per block, what a per-block replay target could store: each block's
  first-order share of the output change, ‖W_o,h Σ_{i∈b} p_i (v_i − o)‖ summed over answer queries, then summed
  (or max) over heads; the dropped candidates' share of the candidates' total,

each the mean over layers, then the within-episode Spearman against the JSON's live KL. Then what a record could
store of the exact change (``o' − o = −Σ_{b∈D} c_b / (1 − P_D)`` per head, ``c_b = Σ_{i∈b} p_i (v_i − o)``):

- ``exact_check``: that formula through ``o_proj`` (must equal ``proj_abs``: the algebra's check),
- ``lin``: Σ_q ‖Σ_h Σ_{b∈D} W_o,h c_b‖², no renormalisation; ``lin_layer_denom`` / ``lin_head_denom``: divided by
  the layer's / each head's mean (1 − P_D) over the answer queries,
- ``sketch*``: the same three from a random projection (width ``SKETCH``, the third argument, default 64) of each
  block's vector over answer queries × hidden: ``[L, N, SKETCH]`` (per head: ``[L, H, N, SKETCH]``) per record.

Writes ``output_sketch{SKETCH}_seed{seed}.json`` beside the source.

    python benchmarks/ranker_fidelity_value/output_error.py results/ranker_fidelity_value/seed7.json 2
    python benchmarks/ranker_fidelity_value/output_error.py results/ranker_fidelity_value/seed9.json 3 256
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np
import torch
from common import (
    block_terms,
    capturing_qkv,
    decision_points,
    fidelity_policies,
    load_fidelity,
    spearman_summary,
)

from cache.models import load_model
from cache.ranking import RANK_FEATURES
from kvgym.envs.decisions import Decisions

source, n = sys.argv[1], int(sys.argv[2])
SKETCH = int(sys.argv[3]) if len(sys.argv) > 3 else 64  # the random projection's width (per layer and block)
data, live, budgets = load_fidelity(source)
policies = fidelity_policies()
loaded = load_model(data["model"])
model, tok = loaded.model, loaded.tokenizer


def heads_concatenated(x):
    """[H, Q, d] → [Q, H*d]: the input of ``o_proj``."""
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


LINEAR = ("exact_check", "lin", "lin_layer_denom", "lin_head_denom", "sketch", "sketch_layer_denom",
          "sketch_head_denom")
layers_out = model.model.layers
rows = []
for sample_name, shared, record, decision in decision_points(data, n, model, tok):
    with capturing_qkv() as captured:
        decision._log_probs(shared.cache.clone())
    context = shared.dense_end
    num_blocks = record["features"].shape[1]
    assert num_blocks == -(-context // 16), (num_blocks, context)
    block_of = torch.arange(context) // 16
    full, contrib, sketches = {}, {}, {}
    for layer, (q, k, v) in captured.items():
        s, probs, vv, o, mass, c = block_terms(q, k, v, context, num_blocks)
        heads, q_len, dim = q.shape
        w = layers_out[layer].self_attn.o_proj.weight.float()
        full[layer] = (s, vv, o, w, probs[..., :context])
        # each block's own contribution to each head's output change if it alone were dropped (first order):
        # c_b = sum_{i in b} p_i (v_i - o), through the head's slice of o_proj; its norm summed over queries
        w_heads = w.reshape(w.shape[0], heads, dim).permute(1, 2, 0)  # [H, d, hidden]
        wc = torch.einsum("hqnd,hdk->hqnk", c, w_heads)  # [H, Q, N, hidden]: each block's term through o_proj
        contrib[layer] = wc.norm(dim=-1).sum(1)  # [H, N]
        gen = torch.Generator().manual_seed(layer)
        sketch = torch.randn(q_len * wc.shape[-1], SKETCH, generator=gen) / SKETCH ** 0.5
        sketches[layer] = (wc, mass, torch.einsum("hqnk,qkr->hnr", wc, sketch.reshape(q_len, -1, SKETCH)))
    for budget in budgets:
        d = Decisions([record], budgets=(budget,))
        pinned_valid = ~d.candidates & (d.features[..., RANK_FEATURES.index("valid")] > 0)
        for name, score in policies.items():
            scores = score(d.features)
            keep = d.kept(scores) | pinned_valid  # [L, N]
            per = {m: [] for m in ("out_rel", "proj_rel", "proj_abs", "lost", "contrib", "contrib_max", *LINEAR)}
            for layer, (s, vv, o, w, p_ctx) in full.items():
                dropped_blocks = d.candidates[layer] & ~keep[layer]
                for m, c in (("contrib", contrib[layer].sum(0)), ("contrib_max", contrib[layer].amax(0))):
                    per[m].append(float(c[dropped_blocks].sum() / c[d.candidates[layer]].sum()))
                token_keep = torch.cat([keep[layer][block_of], torch.ones(s.shape[-1] - context, dtype=torch.bool)])
                o2 = torch.softmax(s.masked_fill(~token_keep, -torch.inf), -1) @ vv
                delta = o2 - o
                per["out_rel"].append(float(delta.pow(2).sum() / o.pow(2).sum()))
                pd, po = heads_concatenated(delta) @ w.T, heads_concatenated(o) @ w.T
                per["proj_rel"].append(float(pd.pow(2).sum() / po.pow(2).sum()))
                per["proj_abs"].append(float(pd.pow(2).sum()))
                dropped = ~keep[layer][block_of]
                lost = (p_ctx[..., dropped].sum(-1)).amax(0).sum() / p_ctx.sum(-1).amax(0).sum()
                per["lost"].append(float(lost))
                wc, mass, sk = sketches[layer]
                dropped_mass = (mass * dropped_blocks).sum(-1)  # [H, Q]
                summed = torch.einsum("hqnk,n->hqk", wc, dropped_blocks.float())  # [H, Q, hidden]
                per["exact_check"].append(float((summed / (1 - dropped_mass)[..., None]).sum(0).pow(2).sum()))
                per["lin"].append(float(summed.sum(0).pow(2).sum()))
                per["lin_layer_denom"].append(per["lin"][-1] / float(1 - dropped_mass.mean()) ** 2)
                head_denom = 1 - dropped_mass.mean(1)  # [H]
                per["lin_head_denom"].append(float((summed / head_denom[:, None, None]).sum(0).pow(2).sum()))
                sk_d = torch.einsum("hnr,n->hr", sk, dropped_blocks.float())  # [H, r]
                per["sketch"].append(float(sk_d.sum(0).pow(2).sum()))
                per["sketch_layer_denom"].append(per["sketch"][-1] / float(1 - dropped_mass.mean()) ** 2)
                per["sketch_head_denom"].append(float((sk_d / head_denom[:, None]).sum(0).pow(2).sum()))
            key = (sample_name, budget, name)
            rows.append({"sample": key[0], "budget": budget, "policy": name, "live_kl": live[key],
                         "replay_regret": float(d.regret(scores).mean()),
                         **{m: float(np.mean(x)) for m, x in per.items()},
                         **{f"{m}_layers": x for m, x in per.items()}})
    print(sample_name, flush=True)

metrics = ["replay_regret", "out_rel", "proj_rel", "proj_abs", "lost", "contrib", "contrib_max", *LINEAR]
summary = spearman_summary(rows, metrics)
out = os.path.join(os.path.dirname(source), f"output_sketch{SKETCH}_seed{data['seed']}.json")
json.dump({"source": source, "summary": summary, "rows": rows}, open(out, "w"))
print("wrote", out)
