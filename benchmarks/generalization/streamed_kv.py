"""Issue 36, a diagnosis: how much of what a streamed run loses at the question can any question-time choice win back?

For each sample (the held-out ones the full cache answers and the policy with the draft does not, read from the
committed records), the shipped policy runs the streaming protocol (2k, plain, host 512) and at its question's
decision point this script answers greedily on copies of the cache (``cache.copies.resident_copy``, blocks read where they
lie), the run itself untouched:

- ``chosen``: the device set the policy's question decision keeps (what the run's first answer token sees);
- ``every_block``: every live block, device and host, with the KV as streamed (each token's keys and values computed
  while only the device blocks of its time were attended): the best any question-time selection could do;
- ``every_block_question_reread``: the same with the question's tokens re-encoded against every live block first
  (the question's KV as a full cache would compute it over the streamed context).

The gap between ``every_block`` and the full cache is what the prefill's choices lost in the KV itself, which no
later choice restores; the prefetching oracle's prefill avoids it by knowing the future.

    python -m benchmarks.generalization.streamed_kv --budget 0.125 \
        --records results/generalization/heldout_stream_2k_plain_lookahead_samples.jsonl.gz \
        results/generalization/heldout_stream_2k_plain_samples.jsonl.gz --json results/generalization/streamed_kv_0.125.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

POLICY = "ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0"
COMPARED = POLICY + ",lookahead=8"  # the headline setting: the samples it misses and the full cache answers
STEPS = 40  # greedy answer tokens on each copy (a UUID takes ~30)


def missed_samples(paths: list[str], budget: float) -> list[int]:
    from eval.report import unique_records

    records = unique_records(paths)
    full = {r["index"]: r["score"] for r in records if r["controller"] == "full"}
    return sorted(r["index"] for r in records if r["controller"] == COMPARED and r["budget"] == budget
                  and r["score"] < 1 and full.get(r["index"], 0) >= 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=0.125)
    parser.add_argument("--records", nargs="+", required=True, help="held-out records with the full cache and the headline setting")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    import numpy as np
    import torch

    from agents.registry import make_controller
    from cache.copies import resident_copy
    from cache.models import load_model
    from eval.harness import _Context, score_sample
    from eval.tasks.base import sample_seed
    from eval.tasks.families import families_heldout
    from eval.tasks.prompt import build_prompt

    loaded = load_model("smollm2-135m")
    model, tokenizer = loaded.model, loaded.tokenizer
    context = _Context(model, tokenizer, False, 512, 16, 64, 8, protocol="streaming")

    @torch.no_grad()
    def answer_on(view, chosen, question, last, reread):
        copy, _ = resident_copy(view, len(question) + STEPS + 2, drop_newest=len(question) if reread else 0,
                                chosen=torch.from_numpy(chosen))
        if reread:
            model(input_ids=torch.tensor([question]), cache=copy, use_cache=True, logits_to_keep=1,
                  position_ids=torch.arange(view.seen - len(question), view.seen)[None])
        token, position, tokens = last, view.seen, []
        for _ in range(STEPS):
            out = model(input_ids=torch.tensor([[token]]), cache=copy, use_cache=True, logits_to_keep=1,
                        position_ids=torch.tensor([[position]]))
            token, position = int(out.logits[0, -1].argmax()), position + 1
            tokens.append(token)
        copy.close()
        return tokenizer.decode(tokens, skip_special_tokens=True)

    class AtQuestion:  # the policy, answering on copies at its question's decision point
        def __init__(self, prompt):
            self.inner, self.prompt, self.texts = make_controller(POLICY), prompt, None

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decide(self, view):
            placement = self.inner.decide(view)
            if view.phase == "question" and self.texts is None:
                question = self.prompt.ids[self.prompt.context_end:view.seen]
                last = self.prompt.ids[view.seen]
                live = view.live_blocks.numpy()
                self.texts = {"chosen": answer_on(view, np.asarray(placement.device), question, last, False),
                              "every_block": answer_on(view, live, question, last, False),
                              "every_block_question_reread": answer_on(view, live, question, last, True)}
            return placement

    rows = []
    for index in missed_samples(args.records, args.budget):
        task = "families_heldout"
        sample = families_heldout(tokenizer, 2048, sample_seed(7, task, 2048, index), index)
        prompt = build_prompt(tokenizer, sample, chat=False)
        spy = AtQuestion(prompt)
        context.run(spy, args.budget, prompt, sample, None)
        row = {"index": index, "family": sample.meta["family"], "gold": sample.outputs,
               **{name: {"score": score_sample(sample, text), "text": text[:60]} for name, text in spy.texts.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {name: sum(r[name]["score"] for r in rows) for name in ("chosen", "every_block", "every_block_question_reread")}
    out = {"budget": args.budget, "policy": POLICY, "compared": COMPARED, "samples": len(rows), "answered": summary,
           "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
