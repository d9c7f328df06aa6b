#!/usr/bin/env bash
# Issue 40: five turns. The multiturn protocol (the context streamed, one device budget across turns, every later
# question asked after the previous answer, host tier of 512 blocks), plain prompts, 2k tokens, 8x and 16x
# compression, the five-turn tasks mt_niah5 / mt_passkey5 / mt_kv5. Run with N=4 (a probe: the full cache scores
# 0.70 / 0.35 / 0.00, below the 0.8 bar, so no cell counts and it was not extended).
# One thread; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_2k_multiturn5}
if [ -n "${FULL_ONLY:-}" ]; then  # the full cache alone (is the task within the model's reach?), mt_niah5 / mt_passkey5
  kvgym eval --protocol multiturn --no-chat --host-blocks 512 --lengths 2048 --n ${N:-20} --seed 7 \
    --tasks mt_niah5,mt_passkey5 --budgets 0.125 --controllers full --no-plots --out ${OUT}_full
  exit 0
fi
kvgym eval --protocol multiturn --no-chat --host-blocks 512 --lengths 2048 --n ${N:-20} --seed 7 \
  --tasks mt_niah5,mt_passkey5,mt_kv5 --budgets 0.125,0.0625 \
  --controllers snapkv,tova,keydiff,knorm,quest,ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0 \
  --no-plots --out $OUT
kvgym report $OUT --leaderboard results/headroom_2k_multiturn5 --min-full 0.8
