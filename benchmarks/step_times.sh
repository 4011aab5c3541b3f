#!/usr/bin/env bash
# Per-phase time of one training step of each method, measured alone (no other run sharing the cores):
# each method's resolved grid config, 384 rollouts, 2 threads; the median over the steps after the first
# (the step column: the median of the steps' sums). Reads GRID_RUNS/<method>/seed0/grid_config.yaml (any
# grid's run directory: the comparison grid, runs/compare_toolworld by default, or the search's, e.g.
# GRID_RUNS=runs/search2 METHODS="grpo@base lopd@base").
# A method without a grid run directory is taken as a bundled config's name (METHODS="grpo lopd_compressor").
# EXTRA: overrides for every run (e.g. EXTRA="train.return_host_memory_from_gib=0"); TAG names the runs.
#   bash benchmarks/step_times.sh
set -euo pipefail
lopd=${LOPD:-.venv/bin/lopd}
grid=${GRID_RUNS:-runs/compare_toolworld}
export METHODS=${METHODS:-grpo opsd sdpo skill_sd lopd} TAG=${TAG:-}
for m in $METHODS; do
  rm -rf "/tmp/lopd-steptime-$m$TAG"
  # shellcheck disable=SC2086
  config="$grid/$m/seed0/grid_config.yaml"; [ -f "$config" ] || config="$m"
  $lopd train --config "$config" run.dir="/tmp/lopd-steptime-$m$TAG" \
    train.max_rollouts=384 eval.every_rollouts=0 eval.max_tasks=8 train.threads=2 run.progress=false ${EXTRA:-} >/dev/null 2>&1
done
${PYTHON:-.venv/bin/python} - <<'PY'
import json, os, statistics
phases = ("sync", "rollout", "score", "correct", "context", "update", "remember")  # sync, correct: vLLM only
print("| method | " + " | ".join(phases) + " | step | peak RSS GiB | host memory returned |")
print("|---|" + "---:|" * (len(phases) + 3))
for m in os.environ["METHODS"].split():
    rows = [json.loads(l) for l in open(f"/tmp/lopd-steptime-{m}{os.environ['TAG']}/metrics.jsonl")]
    rows = [r for r in rows if r["kind"].startswith("train")][1:]
    med = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in phases}
    peak = max(r.get("memory/peak_rss_gib", 0.0) for r in rows)
    returned = sum(r.get("memory/returned_to_os", 0.0) for r in rows) / len(rows)
    step = statistics.median(sum(r.get(f"time/{p}", 0.0) for p in phases) for r in rows)
    print(f"| {m}{os.environ['TAG']} | " + " | ".join(f"{v:.2f}" for v in med.values()) +
          f" | {step:.2f} | {peak:.2f} | {returned:.0%} |")
PY
