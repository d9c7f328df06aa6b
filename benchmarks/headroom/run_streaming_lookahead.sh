#!/usr/bin/env bash
# Issue 40, sixth session: the streamed 2k grid (plain, host 512, 16x / 32x, n = 20 per task) with the draft, which
# postdates it: the headline policy (`lookahead=8`) and the draft behind KeyDiff, the best baseline of the grid.
# The full cache's records are taken from results/headroom_2k_streaming (the same samples; not run again).
set -euo pipefail
. benchmarks/seed_full.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_2k_streaming_lookahead}
seed_full $OUT results/headroom_2k_streaming/samples.jsonl.gz
kvgym eval --protocol streaming --no-chat --host-blocks 512 --lengths 2048 --n ${N:-20} --seed 7 \
  --tasks passkey,niah_single --budgets 0.0625,0.03125 --batch-runs \
  --controllers ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,lookahead:keydiff \
  --no-plots --out $OUT
# The leaderboard over the grid and these runs (results/headroom_2k_streaming/leaderboard.*; the PNG was then
# reduced to 64 colours with Pillow's quantize, FASTOCTREE)
ALL=${ALL:-out/headroom_2k_streaming_all}
mkdir -p $ALL && cp $OUT/eval_config.json $ALL/
(zcat results/headroom_2k_streaming/samples.jsonl.gz; grep -v '"controller": "full"' $OUT/samples.jsonl) > $ALL/samples.jsonl
kvgym report $ALL --leaderboard results/headroom_2k_streaming --min-full 0.8
# 8k streamed niah_single at 16x (n = 10): the policy with the draft (the full cache's records from
# results/headroom_8k_streaming, where KeyDiff answered 1.00 and the policy without the draft 0.50)
OUT8=${OUT8:-out/headroom_8k_streaming_lookahead}
seed_full $OUT8 results/headroom_8k_streaming/samples.jsonl.gz
kvgym eval --protocol streaming --no-chat --host-blocks 512 --lengths 8000 --n 10 --seed 7 --tasks niah_single \
  --budgets 0.0625 --batch-runs --controllers ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8 \
  --no-plots --out $OUT8
