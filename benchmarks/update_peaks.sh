#!/usr/bin/env bash
# Each method's per-phase step time and resident-memory peak on SmolLM2-135M-Instruct + LoRA on HumanEval
# (configs/humaneval_smollm2.yaml after the method's own config), against the update planner's budget:
# STEPS steps of TASKS x 8 rollouts, evaluations cut to 2 problems (at start and end), one run at a time on both cores. RESULTS.md section 20.
# BUDGET sets train.memory_budget_gib (10, the grid's); EXTRA adds overrides to every run; TAG names the runs.
#   bash benchmarks/update_peaks.sh                      # METHODS="grpo opsd lopd" STEPS=3 TASKS=4
set -euo pipefail
lopd=${LOPD:-.venv/bin/lopd}
export METHODS=${METHODS:-grpo opsd lopd} TAG=${TAG:-} BUDGET=${BUDGET:-10} TASKS=${TASKS:-4}
steps=${STEPS:-3} tasks=$TASKS
for m in $METHODS; do
  dir="/tmp/lopd-peaks-$m$TAG"
  [ -f "$dir/finished" ] && continue  # resumable: a finished method is kept
  cfg="/tmp/lopd-peaks-$m$TAG.yaml"
  printf 'include: [%s.yaml, humaneval_smollm2.yaml]\n' "$m" > "$cfg"
  # shellcheck disable=SC2086
  /usr/bin/time -v -o "$dir.time" $lopd train --config "$cfg" run.dir="$dir" rollout.tasks_per_step="$tasks" \
    rollout.batch_size=$((tasks * 8)) train.max_rollouts=$((steps * tasks * 8)) eval.every_rollouts=0 eval.max_tasks=2 \
    train.memory_budget_gib="$BUDGET" train.threads=2 run.progress=false ${EXTRA:-} > "$dir.log" 2>&1
done
${PYTHON:-.venv/bin/python} - <<'PY'
import json, os, re, statistics
budget = float(os.environ["BUDGET"])
print(f"planner budget (train.memory_budget_gib): {budget:g} GiB")
print("| method | rollout s | update s | update peak GiB (per step) | rollout peak GiB | process peak (time -v) GiB | peak - budget GiB | mixed groups per step |")
print("|---|---:|---:|---|---:|---:|---:|---|")
for m in os.environ["METHODS"].split():
    base = f"/tmp/lopd-peaks-{m}{os.environ['TAG']}"
    rows = [json.loads(l) for l in open(f"{base}/metrics.jsonl")]
    rows = [r for r in rows if r["kind"].startswith("train")]
    med = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in ("rollout", "update")}
    upd = [r.get("memory/peak_rss_gib/update", float("nan")) for r in rows]
    roll = max(r.get("memory/peak_rss_gib/rollout", 0.0) for r in rows)
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{base}.time").read()).group(1))
    peak = kb / 2**20
    live = [round(r.get("reward/mixed_groups", 0.0) * int(os.environ.get("TASKS", 4))) for r in rows]
    print(f"| {m}{os.environ['TAG']} | {med['rollout']:.0f} | {med['update']:.0f} | "
          + ", ".join(f"{u:.2f}" for u in upd) + f" | {roll:.2f} | {peak:.2f} | {peak - budget:+.2f} | "
          + ", ".join(f"{x:g}" for x in live) + " |")
PY
