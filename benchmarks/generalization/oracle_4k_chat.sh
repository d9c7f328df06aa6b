#!/usr/bin/env bash
# Issue 36, ninth session: the prefetching oracle on the cells whose share of the oracle's gain was not measured:
# held-out families at 4k (plain) and at 2k with the chat template (seed 7, n = 30, host 512, both budgets batched).
# Each folder is seeded with the full cache's records of the same samples (reused, not run again). One thread per
# process; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
S="kvgym eval --no-plots --protocol streaming --host-blocks 512 --batch-runs --seed 7 --n 30 --family-split heldout"
S="$S --budgets 0.125,0.25 --controllers oracle:prefetch=true"
. benchmarks/seed_full.sh
case "${1:-4k}" in
  4k) seed_full out/heldout4k_oracle results/generalization/heldout_stream_4k_plain/samples.jsonl.gz
    $S --lengths 4096 --no-chat --out out/heldout4k_oracle ;;
  chat) seed_full out/heldout_chat_oracle results/generalization/heldout_stream_2k_chat/samples.jsonl.gz
    $S --lengths 2048 --out out/heldout_chat_oracle ;;
esac
