#!/usr/bin/env bash
# Issue 40: streaming headroom at 8k tokens (8,000: SmolLM2 has 8,192 positions, the answer needs some): as run_streaming_4k.sh, niah_single only, 16x,
# the top methods of the 2k / 4k streaming grids, n = 10 (~19 min alone on two threads).
# Two threads, alone on the machine; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_8k_streaming}
kvgym eval --protocol streaming --no-chat --host-blocks 512 --lengths 8000 --n ${N:-10} --seed 7 \
  --tasks niah_single --budgets 0.0625 --batch-runs \
  --controllers keydiff,knorm,tova,ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0 \
  --no-plots --out $OUT
