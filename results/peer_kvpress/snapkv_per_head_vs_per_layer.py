# Command: OMP_NUM_THREADS=1 python results/peer_kvpress/snapkv_per_head_vs_per_layer.py 1,4,7,10,0,3
"""Per-KV-head vs per-layer top-k of SnapKV's (kvpress defaults) scores on peer samples: how often the needle's
value tokens survive in each (layer, KV head)."""
import json, sys, torch
import torch.nn.functional as F
from cache.models import load_model
from cache.runner import Runner, Prompt
from cache.paged_cache import CacheConfig
m = load_model("smollm2-135m"); tok = m.tokenizer
rows = [json.loads(l) for l in open("/work/shared/peer/kvpress_2k.jsonl")]
out = []
for index in [int(i) for i in sys.argv[1].split(",")]:
    s = rows[index]
    ids = tok(s["input"] + s["answer_prefix"]).input_ids
    sh = Runner(m.model, None, CacheConfig(block_size=1), protocol="oneshot-question").dense_prefill(Prompt(ids), 4)
    st = sh.cache.stats
    n = sh.dense_end
    heads = st.last_mass_heads[:, :, :n]            # [L, H, n] window (64 queries) attention per query head
    L, H, _ = heads.shape; kvh = 3; w = 64
    pooled = F.avg_pool1d(heads.reshape(L * H, 1, n), 5, stride=1, padding=2).reshape(L, H, n)
    per_kv = pooled.reshape(L, kvh, H // kvh, n).mean(2)   # kvpress: group mean
    keep = int(0.25 * n)
    def topk_mask(scores):  # scores [..., n]; window always kept
        s2 = scores.clone(); s2[..., n - w:] = float("inf")
        idx = s2.topk(keep, dim=-1).indices
        mask = torch.zeros_like(scores, dtype=torch.bool); mask.scatter_(-1, idx, True); return mask
    head_mask = topk_mask(per_kv)                              # [L, kvh, n]
    layer_mask = topk_mask(pooled.mean(1))[:, None].expand(L, kvh, n)  # kvgym: one set per layer
    gold = s["outputs"][0]
    text_ids = ids[:n]
    # value tokens: positions whose decoded text is a piece of the gold number, inside the needle sentence
    pieces = [i for i in range(n) if tok.decode([text_ids[i]]).strip() and tok.decode([text_ids[i]]).strip() in gold]
    needle = [i for i in pieces if gold in tok.decode(text_ids[max(0, i - 6): i + 6])]
    kept_head = head_mask[:, :, needle].all(-1).float().mean().item()
    kept_layer = layer_mask[:, :, needle].all(-1).float().mean().item()
    out.append({"index": index, "task": s.get("task") or index % 3, "needle_tokens": len(needle),
                "kept_all_needle_tokens_per_kv_head_topk": round(kept_head, 3),
                "kept_all_needle_tokens_per_layer_topk": round(kept_layer, 3)})
    print(out[-1], flush=True)
json.dump(out, open("/work/main/results/peer_kvpress/snapkv_per_head_vs_per_layer.json", "w"), indent=1)
