#!/usr/bin/env bash
# Issue 36, fifth session: the 12.5% gap is in the answer's decisions, and a draft that looks ahead. Choices on the
# *validation* families (harness seed 9), the held-out families (seed 7) run once after the choice. Each folder is
# seeded with the full cache's records (same samples: not run again); one process per budget, one thread each.
set -euo pipefail
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
P=policies/ranker_smollm2.pt
S="kvgym eval --no-plots --lengths 2048 --protocol streaming --no-chat --host-blocks 512 --batch-runs"
per_budget() {  # per_budget SPLIT SEED N FULL OUT CONTROLLERS [extra eval flags]
  for b in 0.125 0.25; do
    mkdir -p "$5_$b"; [ -s "$5_$b/samples.jsonl" ] || grep '"controller": "full"' "$4" > "$5_$b/samples.jsonl"
    $S --seed "$2" --n "$3" --family-split "$1" --budgets $b --out "$5_$b" --controllers "$6" "${@:7}" &
  done; wait
}
VAL=out/val_stream_2k_plain/samples.jsonl  # the validation folder of exact_window.sh
# the shipped file decides the prefill and the question, the prefetching oracle the answer's decisions
per_budget validation 9 20 $VAL out/val_split "oracle:prefetch=true,prefill_ranker=$P,ranker_phases=prefill+question"
# decisions at every decode step (the same controller; its records kept apart: they share its name)
per_budget validation 9 20 $VAL out/val_de1 "ranker:$P,stay=2,question_stay=0" --decide-every 1
# the draft at the answer's decision points (chosen here: best summed accuracy, ties to fewer bytes)
per_budget validation 9 20 $VAL out/val_la "ranker:$P,stay=2,question_stay=0,lookahead=8"
# held-out, once: the chosen setting; then the draft behind the best heuristic of each 2k cell (SnapKV at 0.25, Knorm
# at 0.125): what the draft adds without the policy (one per budget, for CPU time)
HELD=out/heldout_stream_2k_plain/samples.jsonl
per_budget heldout 7 30 $HELD out/heldout_lookahead "ranker:$P,stay=2,question_stay=0,lookahead=8"
$S --seed 7 --n 30 --family-split heldout --budgets 0.25 --out out/heldout_lookahead_0.25 --controllers lookahead:snapkv &
$S --seed 7 --n 30 --family-split heldout --budgets 0.125 --out out/heldout_lookahead_0.125 --controllers lookahead:knorm &
wait
# no loss on the project's own templates (chat, the first 10 seed-7 samples per task; the full cache's records from
# the window-vote file's run, out/own_templates_stream_2k_v3)
for b in 0.125 0.25; do
  mkdir -p out/own_la_$b; [ -s out/own_la_$b/samples.jsonl ] || grep '"controller": "full"' out/own_templates_stream_2k_v3/samples.jsonl > out/own_la_$b/samples.jsonl
  kvgym eval --protocol streaming --host-blocks 512 --lengths 2048 --seed 7 --n 10 --budgets $b --batch-runs --no-plots \
    --tasks passkey,niah_single,niah_multikey --controllers "ranker:$P,stay=2,question_stay=0,lookahead=8" --out out/own_la_$b &
done; wait
# the chat-template cell at 0.125 (the full cache's and the no-draft records from out/heldout_stream_2k_chat_v3)
mkdir -p out/heldout_chat_lookahead_0.125
[ -s out/heldout_chat_lookahead_0.125/samples.jsonl ] || grep '"controller": "full"' out/heldout_stream_2k_chat_v3/samples.jsonl > out/heldout_chat_lookahead_0.125/samples.jsonl
kvgym eval --no-plots --lengths 2048 --seed 7 --protocol streaming --host-blocks 512 --budgets 0.125 --n 30 --family-split heldout \
  --batch-runs --controllers "ranker:$P,stay=2,question_stay=0,lookahead=8" --out out/heldout_chat_lookahead_0.125
# sixth session: drafting twice (the second draft on the set the first chose), validation only (not chosen: no
# answer changed at 0.125 / 0.25; +1 sample at 0.0625)
V="ranker:$P,stay=2,question_stay=0,lookahead=8"
mkdir -p out/val_rounds out/val_rounds_0.0625
for d in out/val_rounds out/val_rounds_0.0625; do [ -s $d/samples.jsonl ] || grep '"controller": "full"' $VAL > $d/samples.jsonl; done
$S --seed 9 --n 20 --family-split validation --budgets 0.125,0.25 --out out/val_rounds --controllers "$V,lookahead_rounds=2" &
$S --seed 9 --n 20 --family-split validation --budgets 0.0625 --out out/val_rounds_0.0625 --controllers "$V,$V,lookahead_rounds=2" &
wait
# drafting at the question's decision point too (stopped after 8 samples per budget: worse)
mkdir -p out/val_laq2; [ -s out/val_laq2/samples.jsonl ] || grep '"controller": "full"' $VAL > out/val_laq2/samples.jsonl
$S --seed 9 --n 8 --family-split validation --budgets 0.0625,0.125,0.25 --out out/val_laq2 --controllers "$V,lookahead_question=true"
# sixth session: the chat-template cell at 0.25 with the draft (the same seeding as at 0.125)
mkdir -p out/heldout_chat_lookahead_0.25
[ -s out/heldout_chat_lookahead_0.25/samples.jsonl ] || grep '"controller": "full"' out/heldout_stream_2k_chat_v3/samples.jsonl > out/heldout_chat_lookahead_0.25/samples.jsonl
kvgym eval --no-plots --lengths 2048 --seed 7 --protocol streaming --host-blocks 512 --budgets 0.25 --n 30 --family-split heldout \
  --batch-runs --controllers "ranker:$P,stay=2,question_stay=0,lookahead=8" --out out/heldout_chat_lookahead_0.25
# sixth session: 4k (the full cache's records of out/heldout_stream_4k_plain, which ran the policy, SnapKV and Knorm)
FULL4K=out/heldout_stream_4k_plain/samples.jsonl
S4K="kvgym eval --no-plots --lengths 4096 --protocol streaming --no-chat --host-blocks 512 --batch-runs --seed 7 --n 30 --family-split heldout"
for b in 0.125 0.25; do
  for run in "la:ranker:$P,stay=2,question_stay=0,lookahead=8" "lasnap:lookahead:snapkv"; do
    d=out/heldout4k_${run%%:*}_$b; mkdir -p $d; [ -s $d/samples.jsonl ] || grep '"controller": "full"' $FULL4K > $d/samples.jsonl
    $S4K --budgets $b --out $d --controllers "${run#*:}" &
  done; wait
done
d=out/heldout4k_laknorm_0.125; mkdir -p $d; [ -s $d/samples.jsonl ] || grep '"controller": "full"' $FULL4K > $d/samples.jsonl
$S4K --budgets 0.125 --out $d --controllers lookahead:knorm
