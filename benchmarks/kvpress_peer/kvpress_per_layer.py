"""Does per-KV-head selection explain kvpress's low scores on SmolLM2? Run kvpress's own presses on the peer
samples two ways: as shipped (each KV head keeps its own top-k) and with one token set per layer (the press's
scores averaged over the layer's KV heads, so every head keeps the same tokens, as kvgym does and as
kvpress's own TOVA does).

Runs in a separate environment with kvpress 0.5.5 (not a kvgym dependency):
    python -m venv /tmp/kvpenv && /tmp/kvpenv/bin/pip install torch==2.13.0 "transformers==5.2.*" kvpress==0.5.5
    /tmp/kvpenv/bin/python benchmarks/kvpress_peer/kvpress_per_layer.py run PROMPTS.json OUT.jsonl [press ...]
    python benchmarks/kvpress_peer/kvpress_per_layer.py table OUT.jsonl KVGYM_SAMPLES.jsonl PEER_RESULTS.jsonl
PROMPTS.json: the peer samples' prompt ids as kvgym builds them without a chat template (written by
``kvgym``'s ``eval.harness.prompt_ids``), with their gold strings and ``max_new_tokens``. Protocol
``oneshot-question`` as in ``../shared/peer/README.md``: the press compresses while the model prefills the
prompt but its last token; the last token and the greedy answer run on the compressed cache.
"""
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = str(Path.home() / ".cache/kvgym/models/smollm2-135m-instruct")
RATIO = 0.75  # 25% kept


def presses():
    from kvpress import (
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        PyramidKVPress,
        SnapKVPress,
        TOVAPress,
    )

    return {
        "tova": lambda: TOVAPress(compression_ratio=RATIO),
        "snapkv": lambda: SnapKVPress(compression_ratio=RATIO),
        "snapkv_per_layer": lambda: per_layer(SnapKVPress)(compression_ratio=RATIO),
        "knorm": lambda: KnormPress(compression_ratio=RATIO),
        "knorm_per_layer": lambda: per_layer(KnormPress)(compression_ratio=RATIO),
        "keydiff": lambda: KeyDiffPress(compression_ratio=RATIO),
        "keydiff_per_layer": lambda: per_layer(KeyDiffPress)(compression_ratio=RATIO),
        "expected": lambda: ExpectedAttentionPress(compression_ratio=RATIO),
        "expected_per_layer": lambda: per_layer(ExpectedAttentionPress)(compression_ratio=RATIO),
        "pyramidkv": lambda: PyramidKVPress(compression_ratio=RATIO),
    }


def per_layer(press_class):
    """The press with one token set per layer: its per-KV-head scores averaged over the heads."""

    @dataclass
    class PerLayer(press_class):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = super().score(module, hidden_states, keys, values, attentions, kwargs)
            return scores.mean(dim=1, keepdim=True).expand_as(scores).contiguous()

    PerLayer.__name__ = f"{press_class.__name__}PerLayer"
    return PerLayer




def answer(model, tokenizer, ids, press, max_new_tokens):
    import torch
    from transformers import DynamicCache

    context = torch.tensor([ids[:-1]])
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=context, past_key_values=cache)
    kept = cache.get_seq_length()
    position = torch.tensor([[len(ids) - 1]])
    logits = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=position).logits
    generated = [int(logits[0, -1].argmax())]
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    for step in range(max_new_tokens - 1):
        if generated[-1] in stop:
            break
        logits = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                       position_ids=position + 1 + step).logits
        generated.append(int(logits[0, -1].argmax()))
    return tokenizer.decode(generated, skip_special_tokens=True), kept


def run(prompts_path, out_path, *names):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_grad_enabled(False)
    known = presses()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    prompts = json.loads(Path(prompts_path).read_text())
    with open(out_path, "a") as out:
        for name in names or known:
            start, right = time.time(), 0
            for prompt in prompts:
                text, kept = answer(model, tokenizer, prompt["ids"], known[name](), prompt["max_new_tokens"])
                correct = all(gold.lower() in text.lower() for gold in prompt["outputs"])
                right += correct
                out.write(json.dumps(dict(press=name, index=prompt["index"], correct=correct, kept=kept,
                                          answer=text[:80])) + "\n")
                out.flush()
            print(f"{name}: {right}/{len(prompts)} in {time.time() - start:.0f} s", flush=True)


KVGYM_NAMES = {"snapkv": "snapkv:kernel_size=5,pooling=avgpool", "knorm": "knorm", "keydiff": "keydiff",
               "expected": "expected_attention", "tova": "tova", "pyramidkv": "pyramidkv"}


def table(out_path, kvgym_samples, peer_results):
    """Markdown: per press, kvpress as shipped (the peer file), as rerun here, per layer, and kvgym (block size
    1), with how many samples kvgym and kvpress-per-layer agree on (both right or both wrong)."""
    def read(path):
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

    ours = {(r["press"], r["index"]): r["correct"] for r in read(out_path)}
    peer = {(r["press"], r["index"]): r["correct"] for r in read(peer_results) if r["ratio"] == RATIO}
    kvgym = {(r["controller"], r["index"]): r["score"] == 1.0 for r in read(kvgym_samples)}
    indices = sorted({index for _, index in peer})
    def accuracy(table_, key):
        values = [table_[(key, i)] for i in indices if (key, i) in table_]
        return (sum(values) / len(values), len(values)) if values else (None, 0)

    def show(cell):
        return "—" if cell[0] is None else f"{cell[0]:.3f}"

    summary = {}
    print("| press | n | kvpress (peer file) | kvpress rerun here (same correctness as the peer file) | kvpress per layer | kvgym, block size 1 |"
          " kvgym = kvpress per layer |")
    print("|---|---|---|---|---|---|---|")
    for press, name in KVGYM_NAMES.items():
        if (press, indices[0]) not in ours and (f"{press}_per_layer", indices[0]) not in ours:
            continue

        cells = [accuracy(peer, press), accuracy(ours, press), accuracy(ours, f"{press}_per_layer"),
                 accuracy(kvgym, name)]
        same_rerun = sum(ours[(press, i)] == peer[(press, i)] for i in indices if (press, i) in ours)
        agree = sum(ours[(f"{press}_per_layer", i)] == kvgym[(name, i)] for i in indices
                    if (f"{press}_per_layer", i) in ours and (name, i) in kvgym)

        rerun = show(cells[1]) + (f" ({same_rerun}/{cells[1][1]})" if cells[1][1] else "")
        print(f"| {press} | {len(indices)} | {show(cells[0])} | {rerun} | {show(cells[2])} | {show(cells[3])} | "
              f"{agree}/{cells[2][1]} |")
        summary[press] = dict(kvpress_peer=cells[0][0], kvpress_rerun=cells[1][0], kvpress_rerun_same_correctness=same_rerun,
                              kvpress_per_layer=cells[2][0], kvgym_block_size_1=cells[3][0],
                              kvgym_vs_per_layer_same_correctness=agree)
    return summary


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(*sys.argv[2:])
    elif sys.argv[1] == "table":
        print(json.dumps(table(*sys.argv[2:5]), indent=1), file=sys.stderr)
    else:
        raise SystemExit("usage: kvpress_per_layer.py run PROMPTS OUT [press ...] | table OUT KVGYM_SAMPLES PEER")
