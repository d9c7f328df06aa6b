#!/usr/bin/env bash
# Issue 36, eighth session: the question re-read at 4k on the held-out families (seed 7, n = 30, plain, host 512), run
# once, as reread.sh did at 2k: the policy with its draft and re-read, and the same draft and re-read behind SnapKV
# (the best heuristic of both 4k cells with the draft; Knorm, behind it at 0.125, is not run). Each folder is seeded with the full cache's records of the 4k held-out
# run (the same samples; not run again). One thread per process; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
POLICY="ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,question_reread=true"
S="kvgym eval --no-plots --lengths 4096 --protocol streaming --no-chat --host-blocks 512 --batch-runs --seed 7 --n 30"
S="$S --family-split heldout --budgets 0.125,0.25"
FULL=results/generalization/heldout_stream_4k_plain/samples.jsonl.gz
. benchmarks/seed_full.sh
case "${1:-policy}" in
  policy) seed_full out/heldout4k_reread $FULL; $S --out out/heldout4k_reread --controllers "$POLICY" ;;
  heuristics) seed_full out/heldout4k_reread_heuristics $FULL
    $S --out out/heldout4k_reread_heuristics \
      --controllers lookahead:snapkv,question_reread=true ;;
esac
