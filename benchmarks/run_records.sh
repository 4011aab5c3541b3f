#!/usr/bin/env bash
# A grid's finished runs as small records that travel in git, and back: what `lopd compare --report-only` and
# `benchmarks/eval_outcomes.py` read (config.yaml, grid_config.yaml, metrics.jsonl, samples/, status.json,
# finished; no checkpoints, TensorBoard events or banks), so a grid that outlives one machine resumes on the
# next: restored runs count as finished, the rest are trained, and the report covers them all.
#   bash benchmarks/run_records.sh save    runs/compare_toolworld_smollm2 benchmarks/compare_toolworld_smollm2/records
#   bash benchmarks/run_records.sh restore runs/compare_toolworld_smollm2 benchmarks/compare_toolworld_smollm2/records
# `save` copies finished runs only; `restore` never overwrites a run directory that already exists.
# SAMPLES=ends (save): keep each split's first and last evaluation's samples only (what `eval_outcomes.py --gain`
# and `--versus` read), a fifth of the size for a grid evaluated every 256 rollouts.
set -euo pipefail
mode=${1:?save or restore}; grid=${2:?grid run root}; records=${3:?records folder}
case $mode in
  save)
    for done in "$grid"/*/seed*/finished; do
      [ -f "$done" ] || continue
      run=$(dirname "$done"); dest="$records/${run#"$grid"/}"
      mkdir -p "$dest"
      for f in config.yaml grid_config.yaml metrics.jsonl status.json finished; do
        [ -f "$run/$f" ] && cp "$run/$f" "$dest/"
      done
      [ -d "$run/samples" ] && rm -rf "$dest/samples" && cp -r "$run/samples" "$dest/"
      if [ "${SAMPLES:-all}" = ends ] && [ -d "$dest/samples" ]; then  # each split's first and last evaluation only
        for split in $(ls "$dest/samples" | sed 's/_step.*//' | sort -u); do
          files=$(ls "$dest/samples/${split}"_step*.jsonl | sort)
          echo "$files" | sed '1d;$d' | xargs -r rm
        done
      fi
      echo "saved $run -> $dest"
    done ;;
  restore)
    for done in "$records"/*/seed*/finished; do
      [ -f "$done" ] || continue
      rec=$(dirname "$done"); dest="$grid/${rec#"$records"/}"
      if [ -e "$dest" ]; then echo "kept $dest (exists)"; continue; fi
      mkdir -p "$(dirname "$dest")" && cp -r "$rec" "$dest"
      echo "restored $rec -> $dest"
    done ;;
  *) echo "run_records.sh: the first argument is save or restore, not '$mode'" >&2; exit 2 ;;
esac
