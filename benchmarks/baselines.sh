#!/usr/bin/env bash
# Baselines on the real benchmarks (RESULTS.md section 7): `lopd eval` of a model, greedy, per category.
#
#   bash benchmarks/baselines.sh [MODEL] [N] [OUT]   # MODEL: smollm2-135m (default), tiny or a folder
#                                                    # N: first N rows of each category (0 = all)
# CPU-sized by default (N = 10): the first N rows of every scored category, so the per-category
# numbers are indicative, not the official full-set figures (run with N = 0 on a GPU for those).
set -euo pipefail
model=${1:-smollm2-135m}
n=${2:-10}
out=${3:-benchmarks/baselines}
lopd=${LOPD:-.venv/bin/lopd}
mkdir -p "$out"
ace_normal="normal_single_turn_single_function normal_single_turn_parallel_function normal_multi_turn_user_adjust
  normal_multi_turn_user_switch normal_similar_api normal_preference normal_atom_bool normal_atom_enum normal_atom_number
  normal_atom_list normal_atom_object_deep normal_atom_object_short special_incomplete special_error_param special_irrelevant"
bfcl="simple_python multiple parallel parallel_multiple irrelevance live_simple live_multiple live_irrelevance"

$lopd eval --model "$model" --env acebench --split $ace_normal --json "$out/acebench_$model.json" \
  eval.max_tasks="$n" rollout.max_new_tokens=192 eval.batch_size=10 run.progress=false
$lopd eval --model "$model" --env bfcl --split $bfcl --json "$out/bfcl_$model.json" \
  eval.max_tasks="$n" rollout.max_new_tokens=128 eval.batch_size=10 run.progress=false
$lopd eval --model "$model" --env humaneval:all --json "$out/humaneval_$model.json" \
  eval.max_tasks=$(( n ? 4 * n : 0 )) rollout.max_new_tokens=384 eval.batch_size=8 run.progress=false
