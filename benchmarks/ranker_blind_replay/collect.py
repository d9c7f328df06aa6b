"""Question-blind (``oneshot``) decision points of validation samples with four candidate futures per block:
attention summed over the question + answer (the regret's future), over the answer alone, and the largest
single-query attention (KVzip-style max) over the question + answer or over the answer alone.

    python benchmarks/ranker_blind_replay/collect.py 5 /tmp/blind   # 5 samples per task, seed 102, ~25 s each
"""

import sys
import time
from pathlib import Path

import torch

from cache.controller import CacheView
from cache.models import load_model
from cache.paged_cache import CacheConfig
from cache.ranking import policy_features
from cache.runner import Runner, budget_blocks
from cache.tiers import Tier
from eval.tasks import generate
from eval.tasks.prompt import build_prompt

TASKS, LENGTH, SEED, MAX_NEW_TOKENS = ("passkey", "niah_single", "niah_multikey"), 2048, 102, 24


@torch.no_grad()
def futures_of(model, prompt, max_new_tokens: int, eos: set[int]) -> dict:
    shared = Runner(model, None, CacheConfig(block_size=16), protocol="oneshot").dense_prefill(prompt, max_new_tokens)
    cache = shared.cache.clone(track_query_max=True)
    budget = budget_blocks(0.25, prompt.context_tokens, 16, cache.num_layers, cache.config.sink_blocks + 1)
    view = CacheView.from_cache(cache, budget, phase="compress", question_read=False)
    n = view.num_blocks
    features = torch.from_numpy(policy_features(view)).half()  # now: the view reads the cache lazily
    start = view.acc_mass_heads.clone()
    question = prompt.ids[shared.dense_end:-1]
    for a in range(0, len(question), 64):
        model(input_ids=torch.tensor([question[a:a + 64]]), cache=cache, use_cache=True, logits_to_keep=1)
    read = CacheView.from_cache(cache, budget, phase="prefill")
    after_question, question_max = read.acc_mass_heads[..., :n].clone(), read.query_max_heads[..., :n].clone()
    cache.stats.query_max_heads.zero_()  # from here: the answer's queries alone
    token, answer = prompt.ids[-1], []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        answer.append(token)
        if token in eos:
            break
    end = CacheView.from_cache(cache, budget, phase="decode")
    after_answer, answer_max = end.acc_mass_heads[..., :n], end.query_max_heads[..., :n]
    futures = {"sum_all": after_answer - start, "sum_answer": after_answer - after_question,
               "qmax_all": torch.maximum(question_max, answer_max), "qmax_answer": answer_max}
    return {"features": features,
            "futures": {name: future.float() for name, future in futures.items()},
            "future_heads": futures["sum_all"].float(), "context_tokens": prompt.context_tokens,
            "device_blocks": (view.tier == Tier.DEVICE).sum(dim=1), "sink_blocks": cache.config.sink_blocks,
            "block_size": 16, "answer": torch.tensor(answer)}


def main(per_task: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model("smollm2-135m")
    eos = {int(loaded.tokenizer.eos_token_id)}
    for task in TASKS:
        for index in range(per_task):
            path = out / f"{task}_{index}.pt"
            if path.exists():
                continue
            began = time.perf_counter()
            sample = generate(task, loaded.tokenizer, LENGTH, seed=SEED, index=index)
            prompt = build_prompt(loaded.tokenizer, sample, True)
            record = futures_of(loaded.model, prompt, min(sample.max_new_tokens, MAX_NEW_TOKENS), eos)
            torch.save({**record, "task": task, "index": index}, path)
            print(path.name, f"{time.perf_counter() - began:.1f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
