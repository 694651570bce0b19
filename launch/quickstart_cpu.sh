#!/usr/bin/env bash
# The main job on the embedded default, on a CPU: gate warm-up, joint fine-tuning (LoRA), their
# exports, and the evaluation table (base vs GSM: perplexity, KV bytes per token, gate recall).
set -euo pipefail
cd "$(dirname "$0")/.."
gsm=${GSM_TRAIN:-gsm-train}
$gsm train recipes/quickstart_cpu.yaml --overwrite  # a second run starts over (see README, Reliability)
$gsm train recipes/quickstart_joint_cpu.yaml --overwrite
$gsm eval --model smollm2-135m --data embedded:sample_prose --seq-len 256 --windows 8 --min-keys 128 \
  --export gate_only=runs/quickstart/export --export joint=runs/quickstart_joint/export --out runs/quickstart_eval
