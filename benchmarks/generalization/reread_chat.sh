#!/usr/bin/env bash
# Issue 36, eighth session: the headline setting (draft + question re-read) on the held-out families with the chat
# template (2k, host 512, seed 7, n = 30 per budget), run once; paired with the same policy without the re-read
# (`results/generalization/heldout_stream_2k_chat_lookahead_samples.jsonl.gz`); `heuristic BUDGET`: the same draft and
# re-read behind SnapKV at one budget. Each folder is seeded with the full cache's records of the chat run. One thread.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
POLICY="ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,question_reread=true"
OUT=out/heldout_chat_reread BUDGETS=0.125,0.25
if [ "${1:-policy}" = heuristic ]; then
  POLICY="lookahead:snapkv,question_reread=true" OUT=out/heldout_chat_reread_snapkv_$2 BUDGETS=$2
fi
. benchmarks/seed_full.sh
seed_full $OUT results/generalization/heldout_stream_2k_chat/samples.jsonl.gz
kvgym eval --no-plots --lengths 2048 --protocol streaming --host-blocks 512 --batch-runs --seed 7 --n 30 \
  --family-split heldout --budgets $BUDGETS --out $OUT --controllers "$POLICY"
