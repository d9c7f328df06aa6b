#!/usr/bin/env bash
# Issue 40: the question-blind one-shot protocol (`oneshot`: kvpress's pipeline with the context compressed before
# the question is read) at 16x and 32x compression, plain prompts, 2k tokens, passkey and niah_single (the tasks whose
# full cache passes the 0.8 bar), n = 20 per task, a sample's runs batched. The policy makes these compressions with
# its blind file. One thread; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_2k_oneshot}
kvgym eval --protocol oneshot --no-chat --host-blocks 0 --lengths 2048 --n ${N:-20} --seed 7 \
  --tasks passkey,niah_single --budgets 0.0625,0.03125 --batch-runs \
  --controllers snapkv,tova,keydiff,knorm,kvzip,ranker:policies/ranker_smollm2.pt,blind=policies/ranker_blind_smollm2.pt \
  --no-plots --out $OUT
kvgym report $OUT --leaderboard results/headroom_2k_oneshot --min-full 0.8
