# Sourced by the evaluation scripts: `seed_full FOLDER RECORDS` starts FOLDER/samples.jsonl with the full cache's
# records of RECORDS (.jsonl or .jsonl.gz) when the folder has none yet, so that a folder of new controllers holds
# the same samples' reference beside them (kvgym eval keeps records it finds and runs only what is missing).
seed_full() {
  mkdir -p "$1"
  [ -s "$1/samples.jsonl" ] || zcat -f "$2" | grep '"controller": "full"' > "$1/samples.jsonl"
}
