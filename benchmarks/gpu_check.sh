#!/usr/bin/env bash
# The GPU checks behind RESULTS.md's GPU rows, as one script for one short lease of a CUDA machine that has
# torch, transformers and peft (our pure-Python dependencies can be put on PYTHONPATH beforehand).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # OUT_DIR default: $OUT or /tmp/lopd-gpu-check
#
# 1. the distillation loss stage, chunked against naive, at Qwen3-8B's width and both vocabularies;
# 2. one LOPD and one GRPO step at Qwen3-0.6B's shape (random weights, LoRA, bf16): phase times, peak memory;
# 3. the bundled tiny policy trained with GRPO and with LOPD on the GPU (the CUDA path of the one loop).
# Each part has its own time limit and the next one runs whatever happened.
set -u
out=${1:-${OUT:-/tmp/lopd-gpu-check}}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
py=${PYTHON:-python3}
section() { echo; echo "=== $1 ($(date +%T))"; }

section "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
$py -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| cuda', torch.cuda.is_available())"

section "1. distillation loss stage (B x T = 8 x 1024, H = 4096, bf16 inputs)"
timeout 240 $py benchmarks/distill_memory.py --device "$device" --hidden 4096 --dtype bfloat16 --repeats 5 \
  2>&1 | tee "$out/distill_memory.md"

section "2. one step at Qwen3-0.6B's shape"
for method in lopd grpo; do
  timeout 150 $py benchmarks/scale_smoke.py --method "$method" --shape qwen3-0.6b --device "$device" \
    --steps ${STEPS:-3} --work /tmp/lopd-scale 2>&1 | grep -v -i "warn\|Loading weights\|Writing model" | tee "$out/scale_$method.md"
done

section "3. the tiny policy on the GPU (512 rollouts)"
for method in grpo lopd; do
  extra=(); [ "$method" = lopd ] && extra=(algorithm.retrieval.embedder=backbone)
  /usr/bin/time -f "%e s wall" timeout 150 $py -m lopd.cli train --config "$method" run.dir=/tmp/lopd-tiny-$method \
    train.device="$device" train.max_rollouts=${TINY_ROLLOUTS:-512} eval.every_rollouts=256 run.progress=false \
    "${extra[@]}" 2>&1 | grep -v -i "warn" | tail -4 | tee "$out/tiny_$method.txt"
  cp /tmp/lopd-tiny-$method/metrics.jsonl "$out/tiny_${method}_metrics.jsonl" 2>/dev/null
done
section "done"
