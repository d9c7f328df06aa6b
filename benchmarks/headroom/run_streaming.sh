#!/usr/bin/env bash
# Issue 40: headroom under the streaming protocol (chunked prefill, decisions throughout, host tier of 512 blocks),
# plain prompts, 2k tokens, 16x and 32x compression (6.25% and 3.125% of the context kept), n = 20 per task.
# KVzip has no streaming form (it scores a whole prefilled context), so the baselines here are the streaming ones.
# CHAT=1 runs the chat-template column beside it (OUT / BOARD default to *_chat), a sample's runs batched.
# One thread; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
if [ "${CHAT:-0}" = 1 ]; then PROMPTS="--batch-runs"; SUFFIX=_chat; else PROMPTS="--no-chat"; SUFFIX=; fi
OUT=${OUT:-out/headroom_2k_streaming$SUFFIX}
kvgym eval --protocol streaming $PROMPTS --host-blocks 512 --lengths 2048 --n ${N:-20} --seed 7 \
  --tasks passkey,niah_single --budgets 0.0625,0.03125 \
  --controllers snapkv,tova,keydiff,knorm,quest,streamingllm,ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0 \
  --no-plots --out $OUT
kvgym report $OUT --leaderboard results/headroom_2k_streaming$SUFFIX --min-full 0.8
