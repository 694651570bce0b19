#!/usr/bin/env bash
# The main job on the embedded default, on a CPU: gate warm-up, joint fine-tuning (GSM modules on
# the frozen base), their exports, and the evaluation table (base vs GSM: perplexity, KV bytes per
# token, gate recall) on held-out text: the book's chapters 18-24, which neither stage trains on.
set -euo pipefail
cd "$(dirname "$0")/.."
gsm=${GSM_TRAIN:-gsm-train}
data=runs/quickstart_data
mkdir -p "$data"
head -n 3851 gsm_train/assets/sample_prose.txt >"$data/train.txt"     # chapters 1-17
tail -n +3852 gsm_train/assets/sample_prose.txt >"$data/heldout.txt"  # chapters 18-24
split=("data.train.path=$data/train.txt" "data.eval.path=$data/heldout.txt")
$gsm train recipes/quickstart_cpu.yaml "${split[@]}" --overwrite  # a second run starts over (docs/cli.md)
$gsm train recipes/quickstart_joint_cpu.yaml "${split[@]}" --overwrite
$gsm eval --model smollm2-135m --data "$data/heldout.txt" --seq-len 512 --windows 6 --min-keys 256 \
  --export gate_only=runs/quickstart/export --export joint=runs/quickstart_joint/export --out runs/quickstart_eval
