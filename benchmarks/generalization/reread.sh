#!/usr/bin/env bash
# Issue 36, seventh session: the question re-read (`question_reread=true`) on top of the headline setting. Chosen on the
# *validation* families (harness seed 9; rule fixed before the runs: adopted if its summed accuracy over 0.125 and
# 0.25 beats the setting without it), then the held-out families (seed 7) run once, with the same draft and re-read
# behind the best heuristic of each cell (Knorm at 0.125, SnapKV at 0.25). Each folder is seeded with the full
# cache's records (the same samples; not run again). One thread per process; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
P=policies/ranker_smollm2.pt
POLICY="ranker:$P,stay=2,question_stay=0,lookahead=8,question_reread=true"
S="kvgym eval --no-plots --lengths 2048 --protocol streaming --no-chat --host-blocks 512 --batch-runs"
. benchmarks/seed_full.sh
for b in 0.125 0.25; do
  seed_full out/val_reread_$b results/generalization/validation_families_samples.jsonl.gz
  $S --seed 9 --n 20 --family-split validation --budgets $b --out out/val_reread_$b --controllers "$POLICY"
done
HELD=results/generalization/heldout_stream_2k_plain_samples.jsonl.gz
for b in 0.125 0.25; do
  seed_full out/heldout_reread_$b $HELD
  $S --seed 7 --n 30 --family-split heldout --budgets $b --out out/heldout_reread_$b --controllers "$POLICY"
done
# the same draft and re-read behind the best heuristics of the held-out cells (Knorm, SnapKV; both at both budgets,
# batched: SnapKV ranks with the question's queries, which the re-read changes)
for b in 0.125 0.25; do
  seed_full out/heldout_reread_heuristics_$b $HELD
  $S --seed 7 --n 30 --family-split heldout --budgets $b --out out/heldout_reread_heuristics_$b \
    --controllers lookahead:knorm,question_reread=true,lookahead:snapkv,question_reread=true
done
