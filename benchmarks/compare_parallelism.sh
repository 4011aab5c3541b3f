#!/usr/bin/env bash
# How `lopd compare` should use 2 cores: 2 worker processes x 1 torch thread, or 1 process x 2 threads.
# The same 5 runs (the demo's methods, seed 0, 256 rollouts, one evaluation) each way, back to back.
#
#   bash benchmarks/compare_parallelism.sh
set -euo pipefail
lopd=${LOPD:-.venv/bin/lopd}
for mode in "2 1" "1 2"; do
  set -- $mode
  out=/tmp/lopd-parallel-$1x$2
  rm -rf "$out"
  start=$(date +%s.%N)
  $lopd compare --config configs/compare_demo.yaml out="$out" budget=256 eval_every=256 workers=$1 \
    threads_per_worker=$2 > "$out.log" 2>&1
  echo "$1 process(es) x $2 thread(s): $(echo "$(date +%s.%N) - $start" | bc) s for 5 runs"
done
