#!/usr/bin/env bash
# Issue 40, sixth session: the streamed 2k grid (plain, host 512, 16x / 32x, n = 20 per task) with the draft, which
# postdates it: the headline policy (`lookahead=8`) and the draft behind KeyDiff, the best baseline of the grid.
# The full cache's records are taken from results/headroom_2k_streaming (the same samples; not run again).
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_2k_streaming_lookahead}
mkdir -p $OUT
[ -s $OUT/samples.jsonl ] || zcat results/headroom_2k_streaming/samples.jsonl.gz | grep '"controller": "full"' > $OUT/samples.jsonl
kvgym eval --protocol streaming --no-chat --host-blocks 512 --lengths 2048 --n ${N:-20} --seed 7 \
  --tasks passkey,niah_single --budgets 0.0625,0.03125 --batch-runs \
  --controllers ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,lookahead:keydiff \
  --no-plots --out $OUT
