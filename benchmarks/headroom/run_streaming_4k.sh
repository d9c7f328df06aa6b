#!/usr/bin/env bash
# Issue 40: streaming headroom at 4k tokens (plain, host tier of 512 blocks), 16x (6.25% of the context kept),
# passkey and niah_single, n = 20 per task, a sample's runs batched (--batch-runs). The one-shot grid at
# 4k saturates (everything keeps 1.00 at 16x and 32x: run_4k.sh), so the 4k cell of interest is the streamed one.
# One thread; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_4k_streaming}
kvgym eval --protocol streaming --no-chat --host-blocks 512 --lengths 4096 --n ${N:-20} --seed 7 \
  --tasks niah_single,passkey --budgets 0.0625 --batch-runs \
  --controllers snapkv,tova,keydiff,knorm,quest,ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0 \
  --no-plots --out $OUT
kvgym report $OUT --leaderboard results/headroom_4k_streaming --min-full 0.8
