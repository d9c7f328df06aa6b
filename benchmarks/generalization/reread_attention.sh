#!/usr/bin/env bash
# Issue 36, eighth session: `reread_attention=true`, the question re-read's exact attention to every live block
# taken as the latest statistics (the streamed question's gave only its device blocks). Chosen on the *validation*
# families (harness seed 9, n = 20; rule fixed before the runs: adopted if its summed accuracy over 0.125 and 0.25
# beats `question_reread=true` alone, 0.850 + 0.700), then — only if adopted — the held-out families (seed 7, n = 30)
# run once. Each folder is seeded with the full cache's records (the same samples; not run again). One thread per
# process; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
POLICY="ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,question_reread=true,reread_attention=true"
S="kvgym eval --no-plots --lengths 2048 --protocol streaming --no-chat --host-blocks 512 --batch-runs --budgets 0.125,0.25"
seeded() {  # seeded FOLDER RECORDS: FOLDER holds the full cache's records of RECORDS (a .gz)
  mkdir -p "$1"; [ -s "$1/samples.jsonl" ] || zcat "$2" | grep '"controller": "full"' > "$1/samples.jsonl"
}
case "${1:-validation}" in
  validation) seeded out/val_reread_attention results/generalization/validation_families_samples.jsonl.gz
    $S --seed 9 --n 20 --family-split validation --out out/val_reread_attention --controllers "$POLICY" ;;
  heldout) seeded out/heldout_reread_attention results/generalization/heldout_stream_2k_plain_samples.jsonl.gz
    $S --seed 7 --n 30 --family-split heldout --out out/heldout_reread_attention --controllers "$POLICY" ;;
esac
