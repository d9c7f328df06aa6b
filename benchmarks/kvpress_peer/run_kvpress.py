"""kvpress's own pipeline on kvgym's samples (issue 42): per (press, compression ratio, protocol, sample), whether
the greedy answer holds every gold string, appended to a JSONL file (a rerun skips rows already there).

Runs in a separate environment with kvpress 0.5.5 (not a kvgym dependency):
    python -m venv ../kvpress-venv && ../kvpress-venv/bin/pip install torch==2.13.0 kvpress==0.5.5 "transformers<5.3"
    ../kvpress-venv/bin/python benchmarks/kvpress_peer/run_kvpress.py PROMPTS.json OUT.jsonl \
        --presses none,kvzip,tova --ratios 0.75 --protocols oneshot-question,oneshot
PROMPTS.json is written by ``make_samples.py`` (kvgym's prompt ids, no chat template, and where the context ends).

The protocol, as kvpress's pipeline runs it: the press is active while the model prefills a context in one
forward (``oneshot-question``: the whole prompt but its last token, so query-aware presses see the question;
``oneshot``: the context alone, ``ids[:context_end]``); the rest of the prompt then runs on the compressed cache
with explicit position ids, and the answer is decoded greedily (``max_new_tokens``, stopping at EOS) while the
cache grows. fp32, SmolLM2-135M-Instruct as converted by ``kvgym setup``.

Besides kvpress's presses as shipped, KVzip variants that each remove one difference to kvgym's KVzip:
``kvzip_layerwise`` (the same share pruned in every layer), ``kvzip_shared`` (one token set per layer: a token's
score is its largest over the layer's KV heads, so every head keeps the same tokens) and ``kvzip_layerwise_shared``
(both: kvgym's rule at block size 1). And ``snapkv_per_layer``, ``keydiff_per_layer``, ``expected_per_layer``: the
press with its scores averaged over each layer's KV heads, so every head keeps the same tokens, as kvgym selects.
"""

import argparse
import copy
import json
import time
from collections import Counter
from pathlib import Path

MODEL = str(Path.home() / ".cache/kvgym/models/smollm2-135m-instruct")


KVZIP_VARIANTS = {"kvzip": (False, False), "kvzip_layerwise": (True, False), "kvzip_shared": (False, True),
                  "kvzip_layerwise_shared": (True, True)}  # name -> (layerwise, shared)


def kvzip_scores(model, ids):
    """Prefill ``ids`` and run KVzip's reconstruction once: the cache (the context only, as KVzip leaves it) and
    KVzip's scores ``[L, 1, kv_heads, T]``, so that every selection variant starts from the same scores."""
    import torch
    from kvpress import KVzipPress
    from transformers import DynamicCache

    class KeepScores(KVzipPress):
        def compress_post(self, model):
            self.kept = self.score_val.clone()

    press, cache = KeepScores(compression_ratio=0.5), DynamicCache()
    with press(model):
        model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
    return cache, press.kept


def kvzip_select(model, scores, ratio, layerwise, shared):
    """KVzip's own selection (``KVzipPress.compress_post``) on ``scores``; ``shared``: one token set per layer
    (a token's score is its largest over the layer's KV heads)."""
    from kvpress import KVzipPress

    press = KVzipPress(compression_ratio=ratio, layerwise=layerwise)
    press.score_val = scores.amax(dim=2, keepdim=True).expand_as(scores).clone() if shared else scores.clone()
    press.compress_post(model)


def presses():
    import kvpress as kp
    from kvpress_per_layer import per_layer  # this folder is on sys.path when run as a script

    return {
        "none": None,
        **{name: "kvzip" for name in KVZIP_VARIANTS},  # scored once per sample (``kvzip_scores``)
        "tova": lambda r: kp.TOVAPress(compression_ratio=r),
        "snapkv": lambda r: kp.SnapKVPress(compression_ratio=r),
        "knorm": lambda r: kp.KnormPress(compression_ratio=r),
        "keydiff": lambda r: kp.KeyDiffPress(compression_ratio=r),
        "expected": lambda r: kp.ExpectedAttentionPress(compression_ratio=r),
        "streamingllm": lambda r: kp.StreamingLLMPress(compression_ratio=r),
        "pyramidkv": lambda r: kp.PyramidKVPress(compression_ratio=r),
        # one token set per layer (the press's scores averaged over KV heads), as kvgym selects at block size 1
        "snapkv_per_layer": lambda r: per_layer(kp.SnapKVPress)(compression_ratio=r),
        "keydiff_per_layer": lambda r: per_layer(kp.KeyDiffPress)(compression_ratio=r),
        "expected_per_layer": lambda r: per_layer(kp.ExpectedAttentionPress)(compression_ratio=r),
    }


def answer(model, tokenizer, ids, split, press, max_new_tokens, cache=None):
    """Prefill ``ids[:split]`` under ``press`` (or continue from ``cache``, already holding them), run
    ``ids[split:]`` on the compressed cache, decode greedily."""
    import contextlib

    import torch
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache()
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=torch.tensor([ids[:split]]), past_key_values=cache)
    positions = torch.arange(split, len(ids))[None]
    logits = model(input_ids=torch.tensor([ids[split:]]), past_key_values=cache, position_ids=positions,
                   logits_to_keep=1).logits
    generated = [int(logits[0, -1].argmax())]
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    position = len(ids)
    while len(generated) < max_new_tokens and generated[-1] not in stop:
        logits = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                       position_ids=torch.tensor([[position]])).logits
        generated.append(int(logits[0, -1].argmax()))
        position += 1
    return tokenizer.decode(generated, skip_special_tokens=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--presses", default="none,kvzip,tova,snapkv,knorm,keydiff,expected,streamingllm")
    parser.add_argument("--ratios", default="0.75", help="kvpress compression ratios (0.75 = 25%% kept)")
    parser.add_argument("--protocols", default="oneshot-question")
    parser.add_argument("--limit", type=int, default=None, help="only the first LIMIT samples")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_grad_enabled(False)
    known = presses()
    names = args.presses.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"--presses: unknown {unknown}; known: {', '.join(known)}")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    prompts = json.loads(args.prompts.read_text())[: args.limit]
    done = set()
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            done.add((row["press"], row["ratio"], row["protocol"], row["index"]))
    ratios = [float(r) for r in args.ratios.split(",")]
    with open(args.out, "a") as out:
        for protocol in args.protocols.split(","):
            start, right, count = time.time(), Counter(), Counter()
            for prompt in prompts:
                split = len(prompt["ids"]) - 1 if protocol == "oneshot-question" else prompt["context_end"]
                todo = [(name, ratio) for name in names for ratio in ([0.0] if name == "none" else ratios)
                        if (name, ratio, protocol, prompt["index"]) not in done]
                scored = None  # KVzip's scores, computed once per sample for all its variants and ratios
                for name, ratio in todo:
                    if known[name] == "kvzip":
                        if scored is None:
                            scored = kvzip_scores(model, prompt["ids"][:split])
                        kvzip_select(model, scored[1], ratio, *KVZIP_VARIANTS[name])
                        text = answer(model, tokenizer, prompt["ids"], split, None, prompt["max_new_tokens"],
                                      cache=copy.deepcopy(scored[0]))  # masking writes into the cache's keys
                    else:
                        press = None if known[name] is None else known[name](ratio)
                        text = answer(model, tokenizer, prompt["ids"], split, press, prompt["max_new_tokens"])
                    for layer in model.model.layers:
                        layer.self_attn.masked_key_indices = None
                    correct = all(gold.lower() in text.lower() for gold in prompt["outputs"])
                    right[name, ratio] += correct
                    count[name, ratio] += 1
                    row = dict(press=name, ratio=ratio, protocol=protocol, index=prompt["index"], task=prompt["task"],
                               correct=correct, answer=text[:80])
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    done.add((name, ratio, protocol, prompt["index"]))
            for name, ratio in count:
                print(f"{protocol} {ratio} {name}: {right[name, ratio]}/{count[name, ratio]}", flush=True)
            print(f"{protocol}: {time.time() - start:.0f} s", flush=True)

if __name__ == "__main__":
    main()
