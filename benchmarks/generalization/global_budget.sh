#!/usr/bin/env bash
# Issue 39 (a first measurement, no training): one device budget for the whole model instead of one per layer
# (`--budget-scope global`: keep_top keeps the highest scores over all layers, so the scores decide each layer's
# share). The shipped policy and SnapKV (the best heuristic at 25% on these samples), held-out families, streaming,
# host tier 512, 12.5% kept, n = 30: the same samples as the per-layer table (benchmarks/generalization/eval.sh), so
# the two join by sample. One thread; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/heldout_stream_2k_plain_global}
kvgym eval --no-plots --lengths 2048 --seed 7 --protocol streaming --no-chat --host-blocks 512 --budgets ${BUDGETS:-0.125} \
  --n 30 --family-split heldout --budget-scope global \
  --controllers ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,snapkv --out $OUT
