"""What output_error.py and output_grad.py share: the decision points of a `python -m benchmarks.ranker_tools fidelity` JSON, the
policies it scored, a hook that captures each layer's queries / keys / values, and each block's term of a
layer's attention output (``c_b = Σ_{i∈b} p_i (v_i − o)`` per head)."""
import gzip
import json
import os
from contextlib import contextmanager

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AttentionInterface

from agents.ranker.model import load_ranker
from cache.attention import PAGED_ATTENTION, paged_attention_forward
from cache.paged_cache import CacheConfig
from cache.runner import Runner
from eval.ranking_fidelity import FEATURE_POLICIES, feature_score, fidelity_summary, random_score
from eval.tasks import generate
from eval.tasks.prompt import build_prompt
from kvgym.envs.decisions import LiveDecision, decision_point

BLOCK_SIZE = 16


def load_fidelity(source):
    """The JSON, its live KL by (sample, budget, policy) and its budgets."""
    data = json.loads(gzip.open(source).read() if str(source).endswith('.gz') else open(source).read())
    live = {(r["sample"], r["budget"], r["policy"]): r["live_kl"] for r in data["rows"]}
    return data, live, sorted({r["budget"] for r in data["rows"]})


def fidelity_policies():
    """The policies the fidelity JSONs score, name → scores from a decision's features."""
    ranker, _ = load_ranker("policies/ranker_smollm2.pt")
    return {"ranker:policies/ranker_smollm2.pt": lambda f: ranker(f.float())[0],
            **{name: feature_score(c) for name, c in FEATURE_POLICIES.items()}, "random": random_score(0)}


def decision_points(data, n, model, tok):
    """Per sample of the JSON's tasks (``n`` each): (sample name, dense prefill, decision record, LiveDecision)."""
    eos = {int(tok.eos_token_id)}
    for task in data["tasks"]:
        for index in range(n):
            sample = generate(task, tok, data["length"], seed=data["seed"], index=index)
            prompt = build_prompt(tok, sample, True)
            answer_tokens = min(sample.max_new_tokens, 24)
            runner = Runner(model, None, CacheConfig(block_size=BLOCK_SIZE), protocol="oneshot-question")
            shared = runner.dense_prefill(prompt, answer_tokens)
            record = decision_point(model, prompt, answer_tokens, eos_ids=eos, shared=shared)
            yield f"{task}/{index}", shared, record, LiveDecision(model, prompt, shared, record["answer"].tolist())


@contextmanager
def capturing_qkv():
    """Within the block, every paged attention call also stores its layer's (query, key, value) in the
    dictionary it yields, by layer."""
    captured = {}

    def hook(module, query, key, value, attention_mask, *args, **kwargs):
        captured[module.layer_idx] = (query[0].detach().float(), key[0].detach().float(), value[0].detach().float())
        return paged_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(PAGED_ATTENTION, hook)
    try:
        yield captured
    finally:
        AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)


def block_terms(q, k, v, context, num_blocks):
    """One layer's answer queries ``q [H, Q, d]`` over keys / values ``[KV, T, d]`` (the context first):
    the causal scores ``s [H, Q, T]``, probabilities, the values repeated per query head, the output
    ``o [H, Q, d]``, each context block's mass ``[H, Q, N]`` and term ``c [H, Q, N, d]``."""
    heads, q_len, dim = q.shape
    group = heads // k.shape[0]
    kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = q @ kk.transpose(-1, -2) * dim ** -0.5
    t = k.shape[1]
    causal = torch.arange(t)[None] <= (t - q_len) + torch.arange(q_len)[:, None]
    s = s.masked_fill(~causal, -torch.inf)
    probs = torch.softmax(s, -1)
    o = probs @ vv
    pad = num_blocks * BLOCK_SIZE - context
    p = torch.nn.functional.pad(probs[..., :context], (0, pad)).reshape(heads, q_len, num_blocks, BLOCK_SIZE)
    vb = torch.nn.functional.pad(vv[:, :context], (0, 0, 0, pad)).reshape(heads, num_blocks, BLOCK_SIZE, dim)
    mass = p.sum(-1)
    c = torch.einsum("hqnt,hntd->hqnd", p, vb) - mass[..., None] * o[:, :, None, :]
    return s, probs, vv, o, mass, c


def spearman_summary(rows: list[dict], measures) -> dict:
    """Per measure, the replay-vs-live Spearman over episodes (mean, min, episodes >= 0.8), printed as it goes."""
    summary = {}
    for m in measures:
        table = fidelity_summary(rows, m)
        above = sum(e["spearman"] >= 0.8 for e in table["episodes"])
        summary[m] = {"mean": table["mean_spearman"], "min": table["min_spearman"], "n_ge_0.8": above,
                      "episodes": len(table["episodes"])}
        print(f"{m:14s} mean {table['mean_spearman']:.3f} min {table['min_spearman']:.2f} "
              f">=0.8 {above}/{len(table['episodes'])}")
    return summary
