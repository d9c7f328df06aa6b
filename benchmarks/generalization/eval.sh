#!/usr/bin/env bash
# The leave-family-out evaluation (issue 36): held-out families (eval.tasks.families, split "heldout": wordings,
# fillers and opening lines no policy trained on), harness seed 7 (never collected for training). Plain prompts.
# Each `kvgym eval` resumes; the baselines and the policies run into separate folders (one writer per folder)
# and benchmarks/generalization/summarize.py joins them by sample. ~26 s a 2k streaming run on one thread.
set -euo pipefail
NEW=${NEW:-policies/ranker_smollm2.pt}
E="kvgym eval --no-plots --lengths 2048 --seed 7"
S="$E --protocol streaming --no-chat --host-blocks 512 --budgets 0.125,0.25 --n 30"
# streaming with a host tier: the heuristics and both oracles, then the policies
$S --family-split heldout --controllers keydiff,knorm,oracle:prefetch=true --out out/heldout_stream_2k_plain
$S --family-split heldout --controllers "ranker:$NEW,stay=2" --out out/heldout_stream_2k_plain_policy
# the project's own templates, seed-held-out (the README's earlier table: chat template, same samples)
kvgym eval --no-plots --lengths 2048 --seed 7 --protocol streaming --host-blocks 512 --budgets 0.125,0.25 \
  --tasks passkey,niah_single,niah_multikey --n 10 --controllers "ranker:$NEW,stay=2" --out out/own_templates_stream_2k
# one-shot with the question read: the plain-prefill baselines beside KVzip
$E --protocol oneshot-question --no-chat --host-blocks 0 --budgets 0.125 --n 20 --family-split heldout \
  --controllers "ranker:$NEW,snapkv,tova,knorm,keydiff,expected_attention,kvzip" --out out/heldout_oneshotq_2k_plain
