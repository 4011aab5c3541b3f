#!/usr/bin/env bash
# Issue 31, item 1: where does SmolLM2-135M-Instruct (LoRA) have reward variance? Each candidate task sampled on
# `train` only (24 tasks x 8 samples, temperatures 0.7 and 1.0) by benchmarks/sampling_variance.py; the LoRA
# SFT candidate first trains its adapter (scripts/sft_lora.py, choices read on `val`). Resumable: each JSON
# skips the temperatures it holds, the SFT folder is reused. Results: benchmarks/candidates_smollm2/, RESULTS 20.
#   bash benchmarks/candidates_smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=benchmarks/candidates_smollm2
mkdir -p "$OUT"
measure() {  # name, config, overrides...
    local name=$1 config=$2; shift 2
    $PY benchmarks/sampling_variance.py --config "$config" --tasks 24 --temperatures 0.7 1.0 \
        --out "$OUT/$name.json" train.threads=2 "$@"
}
measure toolworld_zero_shot configs/toolworld_smollm2.yaml model.name=smollm2-135m env.toolworld.shots=0
measure toolworld_3_shots configs/toolworld_smollm2.yaml model.name=smollm2-135m env.toolworld.shots=3
measure bfcl_simple_python configs/bfcl_grpo.yaml model.name=smollm2-135m model.dtype=float32 train.device=cpu \
    'env.bfcl.categories=[simple_python]' rollout.max_new_tokens=64 rollout.group_size=8
if [ ! -f runs/smollm2_sft/config.json ]; then
    $PY scripts/sft_lora.py --model smollm2-135m --steps 40 --batch-size 8 --eval-every 20 --eval-tasks 50 --out runs/smollm2_sft | tee "$OUT/sft_lora.log"
    cp runs/smollm2_sft/training_log.json "$OUT/sft_lora_training_log.json"
fi
measure toolworld_after_sft configs/toolworld_smollm2.yaml model.name=runs/smollm2_sft env.toolworld.shots=0
# a longer SFT (120 steps of 8, about 13 min): does more of the call format give the groups variance?
if [ ! -f runs/smollm2_sft120/config.json ]; then
    $PY scripts/sft_lora.py --steps 120 --eval-every 60 --eval-tasks 50 --out runs/smollm2_sft120 > "$OUT/sft_lora_120.log" 2>&1
    cp runs/smollm2_sft120/training_log.json "$OUT/sft_lora_120_training_log.json"
fi
measure toolworld_after_sft120 configs/toolworld_smollm2.yaml model.name=runs/smollm2_sft120 env.toolworld.shots=0
