#!/usr/bin/env bash
# Per-phase time of one training step of each method, measured alone (no other run sharing the cores):
# each method's comparison-grid config, 3 steps of 128 rollouts, 2 threads; RESULTS.md quotes the median
# of steps 2-3. Needs runs/compare_toolworld (the grid writes each run's resolved grid_config.yaml).
set -euo pipefail
lopd=${LOPD:-.venv/bin/lopd}
for m in ${METHODS:-grpo opsd sdpo skill_sd lopd}; do
  rm -rf /tmp/lopd-steptime-$m
  $lopd train --config runs/compare_toolworld/$m/seed0/grid_config.yaml run.dir=/tmp/lopd-steptime-$m \
    train.max_rollouts=384 eval.every_rollouts=0 eval.max_tasks=8 train.threads=2 run.progress=false >/dev/null 2>&1
done
.venv/bin/python - <<'PY'
import json, os, statistics
print("| method | rollout | context | update | remember | step |\n|---|---:|---:|---:|---:|---:|")
for m in os.environ.get("METHODS", "grpo opsd sdpo skill_sd lopd").split():
    rows = [json.loads(l) for l in open(f"/tmp/lopd-steptime-{m}/metrics.jsonl")]
    rows = [r for r in rows if r["kind"].startswith("train")][1:]
    med = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in ("rollout", "context", "update", "remember")}
    print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in med.values()) + f" | {sum(med.values()):.2f} |")
PY
