#!/usr/bin/env bash
# Issue 36, ninth session: a ranking policy trained on streaming states recorded *with* the question's re-read and its
# attention as the statistics (`reread_attention=true`): the shipped config (`kvgym train --config ranker_smollm2`), its
# drivers (Quest, TOVA) wrapped so that the runner re-reads the question before its decision point
# (`lookahead:BASE,tokens=1,question_reread=true,reread_attention=true`; the draft of one token only touches the first
# decode decision, after the recorded features). The shipped file saw streamed questions only, and reacts to the
# re-read's attention on offloaded blocks by prefetching them en masse (BENCHMARKS, *Two question-time variants*).
#   train       collect + train (~1 h on one thread; --resume after a kill)
#   validation [BUDGET]  the new file with `reread_attention=true` on the validation families (seed 9, n = 20, both budgets),
#               beside the headline setting's records. Rule fixed before the run: adopted if its summed accuracy over
#               0.125 and 0.25 is at least the headline setting's (0.850 + 0.700) and its mean KL to the full cache is
#               lower at both budgets (0.066 / 0.026).
#   heldout [BUDGET]     the held-out families (seed 7, n = 30, both budgets), once, for an adopted file
# Result: rejected on validation (0.750 / 0.700 vs 0.850 / 0.700; BENCHMARKS, *A file trained on the re-read's
# statistics*); the held-out step was not run.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
. benchmarks/seed_full.sh
WRAP="tokens=1,question_reread=true,reread_attention=true"
POLICY="ranker:runs/ranker_reread/policy.pt,stay=2,question_stay=0,lookahead=8,question_reread=true,reread_attention=true"
B=${2:-0.125,0.25}  # one process per budget spreads the runs over two threads
S="kvgym eval --no-plots --lengths 2048 --protocol streaming --no-chat --host-blocks 512 --batch-runs --budgets $B"
case "${1:-train}" in
  train) kvgym train --config ranker_smollm2 name=ranker_reread \
    "collect.drivers=[\"lookahead:quest,$WRAP\", \"lookahead:tova,$WRAP\"]" ${RESUME:+--resume} ;;
  validation) seed_full out/val_reread_trained_$B results/generalization/validation_families_samples.jsonl.gz
    $S --seed 9 --n 20 --family-split validation --out out/val_reread_trained_$B --controllers "$POLICY" ;;
  heldout) seed_full out/heldout_reread_trained_$B results/generalization/heldout_stream_2k_plain_samples.jsonl.gz
    $S --seed 7 --n 30 --family-split heldout --out out/heldout_reread_trained_$B --controllers "$POLICY" ;;
esac
