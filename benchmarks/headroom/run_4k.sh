#!/usr/bin/env bash
# Issue 40: the headroom grid at 4k tokens. kvpress's protocol (oneshot-question, plain prompts), 16x and 32x
# compression, passkey and niah_single (the tasks whose full cache passes the 0.8 bar at 2k), n = 20 per task,
# every run of a sample batched (--batch-runs: one dense prefill, then the runs' forwards in lockstep).
# One thread; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_4k_oneshotq}
kvgym eval --protocol oneshot-question --no-chat --host-blocks 0 --lengths ${LENGTH:-4096} --n ${N:-20} --seed 7 \
  --tasks passkey,niah_single --budgets 0.0625,0.03125 --batch-runs \
  --controllers snapkv,tova,keydiff,knorm,kvzip,ranker:policies/ranker_smollm2.pt --no-plots --out $OUT
kvgym report $OUT --leaderboard results/${BOARD:-headroom_4k_oneshotq} --min-full 0.8
