"""Exploration (not a kvgym command): a **storable** output-aware replay target, the first-order effect of each
dropped block on the answer's next-token distributions, through every later layer.

For every sample of a `python -m benchmarks.ranker_tools fidelity` JSON this recomputes the decision point and runs the teacher-forced
answer once with gradients: for each of the ``top`` most likely tokens ``y`` at each answer position ``q`` (the
full cache's distribution ``p``), the gradient ``g`` of ``log p(y)`` with respect to every layer's attention
contribution to the residual stream (``o_proj``'s output; a total derivative: through all later layers and later
answer positions). Dropping block ``b`` of layer ``l`` changes that layer's attention output, to first order and
without softmax renormalisation, by ``-c_b = -Σ_{i∈b} p_i (v_i - o)`` per head; its effect on ``log p(y)`` is
``a[l, b, q, y] = -sqrt(p_y) g · W_o c_b`` — one number per (layer, block, position, token): ~0.7 MB per decision
point at top 4, what a trace can store. A ranking's predicted KL is then Fisher's quadratic form

- ``fisher``: ½ · mean over q of Σ_y (Σ_l Σ_{b dropped in l} a[l, b, q, y])² (the layers' effects add up first),
- ``fisher_layers``: the same with each layer's square taken apart (cross-layer cancellation ignored),
- ``answer``: top 1 only (the full cache's own answer token; the empirical Fisher),

each compared, within episode, with the JSON's live KL (as output_error.py does with its per-layer measures).

    python benchmarks/ranker_fidelity_value/output_grad.py results/ranker_fidelity_value/seed7.json 2
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
TOP = int(sys.argv[3]) if len(sys.argv) > 3 else 4
data, live, budgets = load_fidelity(source)
policies = fidelity_policies()
loaded = load_model(data["model"])
model, tok = loaded.model, loaded.tokenizer
for parameter in model.parameters():
    parameter.requires_grad_(False)
layers = model.model.layers
probes = {}


def probe(layer):
    """o_proj's output plus a zero leaf: the leaf's gradient is the total derivative at that output."""
    def hook(module, inputs, output):
        probes[layer] = torch.zeros_like(output, requires_grad=True)
        return output + probes[layer]
    return hook


rows = []
for sample_name, shared, record, decision in decision_points(data, n, model, tok):
    hooks = [layers[i].self_attn.o_proj.register_forward_hook(probe(i)) for i in range(len(layers))]
    try:
        with capturing_qkv() as captured, torch.enable_grad():
            logits = model(input_ids=decision.fed, cache=shared.cache.clone(), use_cache=True,
                           logits_to_keep=0).logits[0].float()
            log_p = torch.log_softmax(logits, -1)  # [Q, V]
            top_p, top_y = log_p.detach().exp().topk(TOP, dim=-1)  # [Q, k]
            grads = []  # per token rank k: {layer: [Q, hidden]}
            for k in range(TOP):
                chosen = log_p.gather(-1, top_y[:, k:k + 1]).sum()
                g = torch.autograd.grad(chosen, [probes[i] for i in range(len(layers))], retain_graph=k < TOP - 1)
                grads.append([x[0] for x in g])
    finally:
        for h in hooks:
            h.remove()
    context = shared.dense_end
    num_blocks = record["features"].shape[1]
    effect = []  # [L] of [N, Q, k]
    for layer in range(len(layers)):
        q, k_, v = captured[layer]
        heads, q_len, dim = q.shape
        c = block_terms(q, k_, v, context, num_blocks)[-1]
        w = layers[layer].self_attn.o_proj.weight.float()  # [hidden, H*d]
        g = torch.stack([grads[k][layer] for k in range(TOP)], -1)  # [Q, hidden, k]
        gw = torch.einsum("qck,chd->qhdk", g, w.reshape(w.shape[0], heads, dim))  # gradient at each head's output
        a = -torch.einsum("hqnd,qhdk->nqk", c, gw) * top_p.sqrt()[None]
        effect.append(a)
    effect = torch.stack(effect)  # [L, N, Q, k]
    for budget in budgets:
        d = Decisions([record], budgets=(budget,))
        pinned_valid = ~d.candidates & (d.features[..., RANK_FEATURES.index("valid")] > 0)
        for name, score in policies.items():
            keep = d.kept(score(d.features)) | pinned_valid
            dropped = (d.candidates & ~keep).float()  # [L, N]
            per_layer = torch.einsum("lnqk,ln->lqk", effect, dropped)  # [L, Q, k]
            key = (sample_name, budget, name)
            rows.append({"sample": key[0], "budget": budget, "policy": name, "live_kl": live[key],
                         "replay_regret": float(d.regret(score(d.features)).mean()),
                         "fisher": float(0.5 * per_layer.sum(0).pow(2).sum(-1).mean()),
                         "fisher_layers": float(0.5 * per_layer.pow(2).sum(-1).mean(-1).sum()),
                         "answer": float(0.5 * per_layer[..., 0].sum(0).pow(2).mean())})
    print(sample_name, flush=True)

summary = spearman_summary(rows, ("replay_regret", "fisher", "fisher_layers", "answer"))
out = os.path.join(os.path.dirname(source), f"output_grad_top{TOP}_seed{data['seed']}.json")
json.dump({"source": source, "top": TOP, "summary": summary, "rows": rows}, open(out, "w"))
print("wrote", out)
