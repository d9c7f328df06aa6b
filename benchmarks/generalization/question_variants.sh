#!/usr/bin/env bash
# Issue 36, eighth session: two ways to give the question's decision more than the re-read's queries, each on top of
# the headline setting (`stay=2,question_stay=0,lookahead=8,question_reread=true`):
#   attention  `reread_attention=true`: the re-read's exact attention to every live block becomes the latest statistics
#   draft      `lookahead_question=true,question_draft_live=true`: the question's decision ranked by an 8-token draft
#              on every live block (host ones read where they lie)
# Chosen on the *validation* families (harness seed 9, n = 20; rule fixed before the runs: adopted if its summed
# accuracy over 0.125 and 0.25 beats `question_reread=true` alone, 0.850 + 0.700); the held-out families (seed 7,
# n = 30) only for an adopted one. Neither was adopted (BENCHMARKS, *Two question-time variants*). Each folder is
# seeded with the full cache's records. One thread; reruns resume.
#   benchmarks/generalization/question_variants.sh attention|draft [validation|heldout]
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
case "$1" in
  attention) EXTRA=reread_attention=true ;;
  draft) EXTRA=lookahead_question=true,question_draft_live=true ;;
  *) echo "variant: attention or draft" >&2; exit 2 ;;
esac
POLICY="ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,question_reread=true,$EXTRA"
case "${2:-validation}" in
  validation) SPLIT="--seed 9 --n 20 --family-split validation"; FULL=results/generalization/validation_families_samples.jsonl.gz ;;
  heldout) SPLIT="--seed 7 --n 30 --family-split heldout"; FULL=results/generalization/heldout_stream_2k_plain_samples.jsonl.gz ;;
esac
OUT=out/${2:-validation}_question_$1
. benchmarks/seed_full.sh
seed_full $OUT $FULL
kvgym eval --no-plots --lengths 2048 --protocol streaming --no-chat --host-blocks 512 --batch-runs --budgets 0.125,0.25 \
  $SPLIT --out $OUT --controllers "$POLICY"
