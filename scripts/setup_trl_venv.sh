#!/usr/bin/env bash
# Build the TRL venv (.venv-trl, gitignored) for benchmarks/trl_compare.py: TRL from PyPI with torch 2.13.0
# (the CPU wheel) and transformers / accelerate / peft at requirements.lock's versions (TRL accepts them),
# datasets as pip resolves it for TRL, plus lopd itself (--no-deps) and its light dependencies so that the
# TRL side imports lopd's ToolWorld env, chat-template prompts and checker. Never touches .venv or
# requirements.lock.
#
#   bash scripts/setup_trl_venv.sh           # then:
#   .venv/bin/python benchmarks/trl_compare.py --smoke
#
# Env: PYTHON (default python3, >= 3.10), VENV (default .venv-trl), TRL_VERSION (default 1.16.0),
# TORCH_CPU_INDEX (an extra pip index with torch==2.13.0+cpu, for machines without the local CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-trl}
TRL_VERSION=${TRL_VERSION:-1.16.0}
PIP=("$VENV/bin/pip" --quiet)
EXTRA=()
[ -n "${TORCH_CPU_INDEX:-}" ] && EXTRA=(--extra-index-url "$TORCH_CPU_INDEX")

test -d "$VENV" || "$PYTHON" -m venv "$VENV"
"${PIP[@]}" install --upgrade pip

# 1. Constraints: torch pinned (plain `torch` would pull a multi-GB CUDA build), and the libraries both sides
#    share at requirements.lock's exact versions, so lopd and TRL run the same transformers / torch kernels.
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
grep -E '^(transformers|accelerate|peft|safetensors|tokenizers|numpy|pyyaml|omegaconf|rich)==' requirements.lock >> "$CONSTRAINTS"

# 2. torch, then TRL with what it needs (datasets, pandas, pyarrow, ...), then peft (TRL's `peft` extra:
#    some trainers import it when present) and lopd's light dependencies (config, progress bar, weights I/O).
"${PIP[@]}" install "${EXTRA[@]}" -c "$CONSTRAINTS" "torch==2.13.0"
"${PIP[@]}" install "${EXTRA[@]}" -c "$CONSTRAINTS" "trl==$TRL_VERSION" transformers accelerate peft \
    safetensors tokenizers omegaconf pyyaml rich numpy

# 3. lopd itself, editable, without its dependencies (tensorboard, matplotlib, sentence-transformers: not
#    needed to import lopd.envs.toolworld, lopd.prompts and lopd.models).
"${PIP[@]}" install --no-deps -e .

# 4. Check: the trainers the benchmark uses import, and lopd's env, prompts and checker work here.
OMP_NUM_THREADS=1 "$VENV/bin/python" - <<'EOF'
import torch, transformers, accelerate, datasets, trl
from trl import GRPOConfig, GRPOTrainer
from trl import DistillationConfig, DistillationTrainer
from trl.experimental.sdpo import SDPOConfig, SDPOTrainer
from lopd.envs.toolworld import ToolWorld
from lopd.prompts import encode_prompt
env = ToolWorld()
task = env.tasks("train")[0]
assert env.score(task, "nothing").reward == 0.0
print(f"trl {trl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, datasets {datasets.__version__}: GRPOTrainer, SDPOTrainer, "
      f"DistillationTrainer import; lopd ToolWorld ok")
EOF
