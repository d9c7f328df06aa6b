#!/usr/bin/env bash
# The generalizing ranker (issue 36) and the feature ablation, on benchmarks/generalization/collect.sh's data.
# 1. the policy: warm start (listwise imitation of the future-attention oracle) + policy gradient, one-shot
#    decision points scored at 1/16..1/2 of the context, the absolute-position feature dropped (decided before
#    measuring: a block's fraction of the way through the prompt is where a template puts its needle);
# 2. the ablation: warm start only (30 epochs), one feature group dropped at a time, scored by replay regret on
#    the training families' validation set and on the held-out families' test records (seed 301, never trained
#    on and never used to pick a checkpoint), with the shipped file beside them.
set -euo pipefail
D=${DATA:-data/generalization}
R=${RUNS:-runs/generalization}
T="kvgym ranker train --train $D/train --validation $D/validation --budgets 0.0625,0.125,0.25,0.5"
$T --drop-features position --out $R/ranker
for group in none place attention page_bound keys query_similarity context; do
  drop=$([ $group = none ] && echo "" || echo $group)
  $T --warm-epochs 30 --rl-epochs 0 --drop-features "$drop" --out $R/ablation_$group
done
P="shipped=policies/ranker_smollm2.pt,new=$R/ranker/ranker.pt"
for group in none place attention page_bound keys query_similarity context; do P="$P,$group=$R/ablation_$group/ranker.pt"; done
mkdir -p results/generalization
kvgym ranker regret --records $D/test_heldout --policies "$P" --reference none --json results/generalization/regret_heldout.json
kvgym ranker regret --records $D/validation --policies "$P" --reference none --json results/generalization/regret_validation.json
