#!/usr/bin/env bash
# The window-vote features (issue 36): a policy retrained with them (`kvgym train --config ranker_smollm2
# name=window_vote`), chosen against the shipped file on *validation* samples of training families (harness seed
# 205), then run once on the held-out families (seed 7), beside the heuristic the features come from
# (`quest:queries=window`). Each `kvgym eval` resumes; one writer per folder.
set -euo pipefail
NEW=${NEW:-runs/window_vote/policy.pt}
OLD=policies/ranker_smollm2.pt
S="kvgym eval --no-plots --lengths 2048 --protocol streaming --no-chat --host-blocks 512 --budgets 0.125,0.25"
# validation (training families, seeds never trained on): the choice
$S --seed 205 --n 10 --tasks families_train --out out/val_qwindow \
  --batch-runs --controllers "ranker:$NEW,stay=2,question_stay=0,ranker:$OLD,stay=2,question_stay=0,quest:queries=window"
# held-out families: the report (summarised beside the committed records of the other methods)
$S --seed 7 --n 30 --family-split heldout --out out/heldout_stream_2k_plain_window --batch-runs \
  --controllers "ranker:$NEW,stay=2,question_stay=0,quest:queries=window"
