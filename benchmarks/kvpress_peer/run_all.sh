#!/usr/bin/env bash
# Issue 42: kvgym and kvpress on the same held-out-family samples, as run (two 1-thread lanes side by side).
# kvpress lives in its own environment (see run_kvpress.py); ../kvpress-venv here.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
D=results/kvpress_peer/families_heldout_2k
KVPRESS=${KVPRESS:-../kvpress-venv/bin/python}

# the samples: 30 held-out-family samples at 2k (seed 11), plain prompts
python benchmarks/kvpress_peer/make_samples.py --task families_heldout --length 2048 --n 30 --seed 11 --out $D

# kvpress lane
$KVPRESS benchmarks/kvpress_peer/run_kvpress.py $D/prompts.json $D/kvpress_results.jsonl \
  --presses none,kvzip,kvzip_layerwise,kvzip_shared,kvzip_layerwise_shared --ratios 0.75,0.875 --protocols oneshot-question
$KVPRESS benchmarks/kvpress_peer/run_kvpress.py $D/prompts.json $D/kvpress_results.jsonl \
  --presses tova,snapkv,knorm,keydiff,expected,streamingllm --ratios 0.75 --protocols oneshot-question
$KVPRESS benchmarks/kvpress_peer/run_kvpress.py $D/prompts.json $D/kvpress_results.jsonl \
  --presses none,kvzip,kvzip_shared,tova,knorm --ratios 0.75 --protocols oneshot

# kvgym lane (block size 1, as kvpress keeps tokens)
COMMON=(--tasks-file $D/families_heldout_2k.jsonl --block-size 1 --no-chat --no-plots --seed 11)
kvgym eval "${COMMON[@]}" --protocol oneshot-question --budgets 0.25 --out $D/kvgym_oneshot_question \
  --controllers tova,knorm,keydiff,snapkv:kernel_size=5,pooling=avgpool,expected_attention,streamingllm
# KVzip: kvpress's rule (global over layers, per KV head; kvgym's default since 2026-12-06) and the two rules it
# replaced (run before per-head selection existed, as `kvzip` and `kvzip:layerwise=true`; relabelled to these specs)
kvgym eval "${COMMON[@]}" --protocol oneshot-question --budgets 0.25,0.125 \
  --controllers kvzip:per_head=false,kvzip:layerwise=true,per_head=false --out $D/kvgym_oneshot_question
kvgym eval "${COMMON[@]}" --protocol oneshot-question --budgets 0.25,0.125 --controllers kvzip \
  --out $D/kvgym_oneshot_question_per_head

# the question-blind protocol (kvpress compresses the context alone)
kvgym eval "${COMMON[@]}" --protocol oneshot --budgets 0.25 --out $D/kvgym_oneshot \
  --controllers kvzip,kvzip:per_head=false,tova,knorm


# --- completing the grid (2026-12-06, fourth session): the other presses in `oneshot` at 25% kept, and kvpress's
# KeyDiff and Expected Attention with one token set per layer (``*_per_layer``: their scores averaged over KV heads,
# as kvgym selects), to tell per-KV-head selection from any other difference
$KVPRESS benchmarks/kvpress_peer/run_kvpress.py $D/prompts.json $D/kvpress_results.jsonl \
  --presses keydiff_per_layer,expected_per_layer --ratios 0.75 --protocols oneshot-question
$KVPRESS benchmarks/kvpress_peer/run_kvpress.py $D/prompts.json $D/kvpress_results.jsonl \
  --presses snapkv,keydiff,expected,streamingllm,keydiff_per_layer,expected_per_layer --ratios 0.75 --protocols oneshot
kvgym eval "${COMMON[@]}" --protocol oneshot --budgets 0.25 --out $D/kvgym_oneshot \
  --controllers snapkv:kernel_size=5,pooling=avgpool,keydiff,expected_attention,streamingllm

python benchmarks/kvpress_peer/summarize.py $D --pair kvzip:per_head=false=kvzip_shared \
  --pair kvzip:layerwise=true,per_head=false=kvzip_layerwise_shared --pair keydiff=keydiff_per_layer \
  --pair expected_attention=expected_per_layer
# committed compressed (kvgym eval reads a .jsonl.gz tasks file as it is; gunzip the records to add runs to them)
gzip -f $D/kvpress_results.jsonl $D/kvgym_*/samples.jsonl $D/families_heldout_2k.jsonl
