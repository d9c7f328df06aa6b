#!/usr/bin/env bash
# Issue 40: the rest of the streamed 8k grid (8,000 tokens, plain, host 512, n = 10): 32x on passkey and niah_single,
# then passkey at 16x, for the grid's strongest methods at 8k (KeyDiff, Knorm), the policy with and without the
# draft, and the draft behind KeyDiff. niah_single 16x is in run_streaming_8k.sh / run_streaming_lookahead.sh; the
# full cache's niah_single records are taken from results/headroom_8k_streaming (the same samples; not run again).
# One thread (~1 h per budget beside another job); reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_8k_streaming_more}
. benchmarks/seed_full.sh
seed_full $OUT results/headroom_8k_streaming/samples.jsonl.gz
POLICY=ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0
for cell in "passkey,niah_single 0.03125" "passkey 0.0625"; do
  set -- $cell
  kvgym eval --protocol streaming --no-chat --host-blocks 512 --lengths 8000 --n ${N:-10} --seed 7 --tasks $1 \
    --budgets $2 --batch-runs --controllers keydiff,knorm,$POLICY,$POLICY,lookahead=8,lookahead:keydiff \
    --no-plots --out $OUT
done
