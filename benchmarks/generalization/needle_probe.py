"""Where the needle is at the answer's first decisions, with and without the question re-read (issue 36, eighth
session): the project's own passkey template (chat, 2k, harness seed 7), streamed at 0.125 with a host tier of 512
blocks, the headline policy with and without `question_reread=true`. For each run it prints the share of layers
whose device set holds the needle's blocks after the question's decision and the first two decode decisions, and
the answer. One thread; ~1 min a run.

    python -m benchmarks.generalization.needle_probe --indices 0,5,8
"""

from __future__ import annotations

import argparse

import torch

from agents.registry import make_controller
from cache.models import load_model
from cache.paged_cache import CacheConfig
from cache.runner import Runner, sentence_end_token_ids
from eval.inputs import task_generator
from eval.tasks.base import sample_seed
from eval.tasks.prompt import answer_positions, build_prompt

POLICY = "ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8"


def probe(model, tokenizer, spec: str, prompt, needle: list[int], budget: float, max_new_tokens: int):
    """``(phase, share of layers holding every needle block on device)`` of the question's and the first two decode
    decisions, and the answer's text."""
    controller, shares = make_controller(spec), []
    decide = controller.decide

    def recording(view):
        placement = decide(view)
        if view.phase in ("question", "decode") and sum(phase == "decode" for phase, _ in shares) < 2:
            shares.append((view.phase, round(float(placement.device[:, needle].all(axis=1).mean()), 2)))
        return placement

    controller.decide = recording
    runner = Runner(model, None, CacheConfig(block_size=16, host_blocks=512), controller=controller, budget=budget,
                    prefill_chunk=64, decide_every=8, protocol="streaming")
    runner.tokenizer, runner.sentence_end_ids = tokenizer, sentence_end_token_ids(tokenizer)
    return shares, runner.run(prompt, max_new_tokens=max_new_tokens).text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--indices", default="0,5,8", help="passkey sample indices (harness seed 7, 2k, chat)")
    parser.add_argument("--budget", type=float, default=0.125)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model()
    generate = task_generator("passkey")
    for index in (int(part) for part in args.indices.split(",")):
        sample = generate(loaded.tokenizer, 2048, sample_seed(7, "passkey", 2048, index), index)
        prompt = build_prompt(loaded.tokenizer, sample, True)
        needle = sorted({position // 16 for position in answer_positions(loaded.tokenizer, sample, True)})
        for spec in (POLICY, POLICY + ",question_reread=true"):
            shares, text = probe(loaded.model, loaded.tokenizer, spec, prompt, needle, args.budget, sample.max_new_tokens)
            print(index, "re-read" if "reread" in spec else "plain  ", needle, shares, repr(text[:40]), flush=True)


if __name__ == "__main__":
    main()
