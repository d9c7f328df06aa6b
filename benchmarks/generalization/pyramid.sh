#!/usr/bin/env bash
# Issue 39, ninth session: a hand-set allocation across layers behind the policy, the baseline a learned (global)
# allocation must beat: the headline setting with PyramidKV's pyramid of layer budgets (`pyramid_beta=20`, the paper's
# steepness; the same total as the even split), on the held-out families (2k, plain, host 512, seed 7, n = 30), paired
# with the headline setting's records (even split). Seeded with the full cache's records.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
. benchmarks/seed_full.sh
B=${1:-0.125}
POLICY="ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0,lookahead=8,question_reread=true,pyramid_beta=20"
seed_full out/heldout_pyramid_$B results/generalization/heldout_stream_2k_plain_samples.jsonl.gz
kvgym eval --no-plots --lengths 2048 --protocol streaming --no-chat --host-blocks 512 --batch-runs --seed 7 --n 30 \
  --family-split heldout --budgets $B --out out/heldout_pyramid_$B --controllers "$POLICY"
