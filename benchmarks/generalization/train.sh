#!/usr/bin/env bash
# The generalizing ranker (issue 36) and the feature ablation, on benchmarks/generalization/collect.sh's data.
# 1. the policy: warm start only (listwise imitation of the future-attention oracle, 30 epochs; the shipped file is
#    its best = last epoch; a policy-gradient stage was started and stopped after one epoch, for time), one-shot
#    decision points scored at 1/16..1/2 of the context, the absolute-position feature dropped (decided before
#    measuring: a block's fraction of the way through the prompt is where a template puts its needle);
# 2. the ablation: warm start only (8 epochs, for time), one feature group dropped at a time, scored by replay regret on
#    the training families' validation set and on the held-out families' test records (seed 301, never trained
#    on and never used to pick a checkpoint), with the shipped file beside them.
set -euo pipefail
D=${DATA:-data/generalization}
R=${RUNS:-runs/generalization}
T="python -m benchmarks.ranker_tools train --train $D/train --validation $D/validation --budgets 0.0625,0.125,0.25,0.5"
$T --warm-epochs 30 --rl-epochs 0 --drop-features position --out $R/ranker   # -> policies/ranker_smollm2.pt
for group in none place attention; do   # page_bound, keys, query_similarity, context: not run yet
  drop=$([ $group = none ] && echo "" || echo $group)
  $T --warm-epochs 8 --rl-epochs 0 --drop-features "$drop" --out $R/ablation_$group
done
P="v1_shipped=policies/ranker_v1_smollm2.pt,new=$R/ranker/ranker.pt"
for group in none place attention; do P="$P,$group=$R/ablation_$group/ranker.pt"; done
mkdir -p results/generalization
python -m benchmarks.ranker_tools regret --records $D/test_heldout --policies "$P" --reference v1_shipped --json results/generalization/regret_heldout.json
python -m benchmarks.ranker_tools regret --records $D/validation --policies "$P" --reference v1_shipped --json results/generalization/regret_validation.json
