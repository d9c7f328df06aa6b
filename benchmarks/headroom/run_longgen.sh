#!/usr/bin/env bash
# Issue 40: long generation under a fixed cache (StreamingLLM's setting). The text_long task: a 2k-token window of
# prose, then its next ~1,024 tokens teacher-forced while the cache holds 12.5% of the context (256 tokens, drop-only:
# no host tier), decisions every 8 decode steps; scored by perplexity and KL to the full cache at every position.
# n = 20, a sample's runs batched (--batch-runs). One thread; reruns resume.
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-out/headroom_2k_longgen}
kvgym eval --protocol streaming --no-chat --host-blocks 0 --lengths 2048 --n ${N:-20} --seed 7 --tasks text_long \
  --budgets 0.125 --batch-runs \
  --controllers streamingllm,h2o,tova,snapkv,keydiff,knorm,ranker:policies/ranker_smollm2.pt,stay=2,question_stay=0 \
  --no-plots --out $OUT
