#!/usr/bin/env bash
# Training data with breadth for the ranking policy (issue 36): decision points of the *training* families
# (eval.tasks.families, split "train"), plain and chat, 1k / 2k / 4k, plus the five original templates, each with
# its one-shot decision point and streaming states (Quest / TOVA driving, host tier of 512 blocks, budgets 0.25 /
# 0.125 in turn). The validation set (checkpoint choice) is more training families on other seeds; the held-out
# families are collected only as a test set for regret (never trained on, never used to pick a checkpoint).
# ~40 s a 2k sample on one thread; reruns resume.
set -euo pipefail
D=${DATA:-data/generalization}
C="python -m benchmarks.ranker_tools collect --drivers quest,tova --streaming-budgets 0.25,0.125 --host-blocks 512"
$C --tasks families_train --lengths 2048 --n 24 --seed 201 --no-chat --out $D/train
$C --tasks families_train --lengths 2048 --n 6 --seed 205 --no-chat --out $D/validation
$C --tasks families_train --lengths 2048 --n 3 --seed 206 --out $D/validation
$C --tasks passkey,niah_single,niah_multikey,niah_multivalue,vt --lengths 2048 --n 3 --seed 101 --out $D/train
$C --tasks families_train --lengths 2048 --n 10 --seed 202 --out $D/train
$C --tasks families_train --lengths 1024 --n 12 --seed 203 --no-chat --out $D/train
$C --tasks families_heldout --lengths 2048 --n 8 --seed 301 --no-chat --out $D/test_heldout
$C --tasks families_train --lengths 4096 --n 4 --seed 204 --no-chat --out $D/train
