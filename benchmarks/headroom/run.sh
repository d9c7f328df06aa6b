#!/usr/bin/env bash
# Issue 40: settings with headroom. kvpress's protocol (oneshot-question, plain prompts) at 16x and 32x compression
# (6.25% and 3.125% of the context kept), 2k tokens, four RULER-style tasks, n = 20 per task; every cell is reported
# beside the full cache, and only cells where the full cache scores >= 0.8 count (kvgym report --leaderboard).
# One thread; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_2k_oneshotq}
kvgym eval --protocol oneshot-question --no-chat --host-blocks 0 --lengths 2048 --n 20 --seed 7 \
  --tasks passkey,niah_single,vt,niah_multivalue --budgets 0.0625,0.03125 \
  --controllers snapkv,tova,keydiff,knorm,kvzip,ranker:policies/ranker_smollm2.pt --no-plots --out $OUT
kvgym report $OUT --leaderboard results/headroom_2k_oneshotq --min-full 0.8
