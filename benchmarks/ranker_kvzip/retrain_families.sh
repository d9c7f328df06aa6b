#!/usr/bin/env bash
# Issue 42: the blind file (question-blind one-shot compressions) retrained on KVzip's corrected selection, on
# training families, and measured on held-out families beside the shipped one.
# - data: question-blind decision points with KVzip's scores (the teacher) of training families and templates
# - teacher:      the shipped recipe (imitate KVzip's block scores, max over query heads; needle weight 1)
# - teacher_kept: the corrected KVzip (kvpress's rule: global over layers, per KV head): each block's target is the
#                 share of its layer's KV heads that keep it at the row's budget (kvgym.envs.decisions.kept_share)
# One thread a process; ~60 s a 2k sample to collect under load; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
D=${DATA:-data/blind_families}
C="python -m benchmarks.ranker_tools collect --blind --blind-only --teacher kvzip"
$C --tasks families_train --lengths 2048 --n 24 --seed 201 --no-chat --out $D/train
$C --tasks families_train --lengths 2048 --n 6 --seed 205 --no-chat --out $D/validation
$C --tasks families_train --lengths 2048 --n 10 --seed 202 --out $D/train
$C --tasks passkey,niah_single,niah_multikey,niah_multivalue,vt --lengths 2048 --n 3 --seed 101 --out $D/train
T="python -m benchmarks.ranker_tools train --train $D/train --validation $D/validation --needle-weight 1 --rl-epochs 0"
$T --target teacher --out runs/blind_families_teacher
$T --target teacher_kept --out runs/blind_families_kept
R=ranker:policies/ranker_smollm2.pt
kvgym eval --protocol oneshot --no-chat --family-split heldout --lengths 2048 --n 30 --seed 7 --host-blocks 0 \
  --budgets 0.125,0.25 --no-plots --out out/heldout_oneshot_2k_blind \
  --controllers "$R,blind=policies/ranker_blind_smollm2.pt,$R,blind=runs/blind_families_teacher/ranker.pt,$R,blind=runs/blind_families_kept/ranker.pt,kvzip,snapkv,tova,knorm,keydiff"
