"""Write held-out-family samples as a kvgym ``--tasks-file`` and their prompt ids for kvpress (issue 42).

Both sides then run the very same samples: kvgym reads the tasks file (``kvgym eval --tasks-file``), kvpress's
runner (``run_kvpress.py``, in its own environment) reads the prompt ids that kvgym builds for it without a chat
template (``eval.tasks.prompt.build_prompt``), with the token where the context ends (``oneshot``: kvpress
compresses ``ids[:context_end]``; ``oneshot-question``: ``ids[:-1]``).

    python benchmarks/kvpress_peer/make_samples.py --task families_heldout --length 2048 --n 30 --seed 11 \
        --out results/kvpress_peer/families_heldout_2k
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="families_heldout")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", type=Path, required=True, help="folder: STEM.jsonl (tasks file) and prompts.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from cache.models import DEFAULT_MODEL, resolve_model
    from eval.inputs import read_tasks_file
    from eval.tasks.base import Sample, get_task
    from eval.tasks.prompt import build_prompt

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    generate = get_task(args.task)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.task}_{args.length // 1024}k"
    tasks_file = args.out / f"{stem}.jsonl"
    with open(tasks_file, "w") as f:
        for index in range(args.n):
            sample = generate(tokenizer, args.length, args.seed, index)
            f.write(json.dumps({"context": sample.context, "question": sample.question,
                                "answer_prefix": sample.answer_prefix, "outputs": sample.outputs,
                                "metric": sample.metric, "max_new_tokens": sample.max_new_tokens}) + "\n")
    prompts = []
    for index, entry in enumerate(read_tasks_file(tasks_file)):  # exactly as kvgym eval reads the file
        sample = Sample(task=stem, length=0, seed=args.seed, index=index, input=entry["input"],
                        question=entry["question"], answer_prefix=entry["answer_prefix"], outputs=entry["outputs"],
                        metric=entry["metric"], max_new_tokens=entry["max_new_tokens"])
        prompt = build_prompt(tokenizer, sample, chat=False)
        prompts.append({"index": index, "task": stem, "ids": prompt.ids, "context_end": prompt.context_end,
                        "outputs": sample.outputs, "max_new_tokens": sample.max_new_tokens})
    (args.out / "prompts.json").write_text(json.dumps(prompts))
    print(f"{tasks_file}: {len(prompts)} samples, {min(len(p['ids']) for p in prompts)}-"
          f"{max(len(p['ids']) for p in prompts)} tokens")


if __name__ == "__main__":
    main()
