#!/usr/bin/env bash
# Issue 36, eighth session: the question's decision ranked by a draft over *every live block*
# (`lookahead_question=true,question_draft_live=true`: 8 tokens drafted from the re-read question on a copy of all
# live blocks, host ones read where they lie, as the re-read reads them), on top of the headline setting. Chosen on
# the *validation* families (harness seed 9, n = 20; rule fixed before the runs: adopted if its summed accuracy over
# 0.125 and 0.25 beats `question_reread=true` alone, 0.850 + 0.700), then — only if adopted — the held-out families
# (seed 7, n = 30) run once, with the same question draft behind SnapKV (`lookahead:snapkv`). Each folder is seeded
# with the full cache's records. One thread per process; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
POLICY="ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,question_reread=true"
POLICY="$POLICY,lookahead_question=true,question_draft_live=true"
S="kvgym eval --no-plots --lengths 2048 --protocol streaming --no-chat --host-blocks 512 --batch-runs --budgets 0.125,0.25"
seeded() {  # seeded FOLDER RECORDS: FOLDER holds the full cache's records of RECORDS (a .gz)
  mkdir -p "$1"; [ -s "$1/samples.jsonl" ] || zcat "$2" | grep '"controller": "full"' > "$1/samples.jsonl"
}
case "${1:-validation}" in
  validation) seeded out/val_question_draft results/generalization/validation_families_samples.jsonl.gz
    $S --seed 9 --n 20 --family-split validation --out out/val_question_draft --controllers "$POLICY" ;;
  heldout) seeded out/heldout_question_draft results/generalization/heldout_stream_2k_plain_samples.jsonl.gz
    $S --seed 7 --n 30 --family-split heldout --out out/heldout_question_draft --controllers "$POLICY" ;;
esac
