"""ACEBench's overall score of a model: agent_multi_step run here as episodes, normal/special from a `lopd eval` JSON.

    .venv/bin/python benchmarks/acebench_overall.py --model tiny
    .venv/bin/python benchmarks/acebench_overall.py --model smollm2-135m --max-turns 20

1. Evaluates the model (`lopd.models.load_policy`, `lopd.evaluation.evaluate`, greedy) on `agent_multi_step`
   with the `acebench_agent` env: multi-turn episodes against the simulated phone, up to `--max-turns`
   replies each (ACEBench allows 20), every episode scored by its end state in both modes, with ACEBench's
   process accuracy beside it. A reply without a call ends the episode; with `--nudge` it is answered "do not
   ask me questions" and the episode goes on, as in ACEBench's own loop (costlier: every episode then runs
   until "finish conversation" or `--max-turns`).
2. Reads the per-category normal and special results of the same model from an existing `lopd eval --json`
   file (default `benchmarks/baselines/acebench_<model>.json`, made by benchmarks/baselines.sh).
3. Combines them the way the released ACEBench evaluator's summary does (`leaderboard_summary`:
   0.578 * mean(12 normal) + 0.2676 * mean(3 special) + 0.1545 * mean(agent_multi_turn, agent_multi_step),
   unweighted means rounded to 3 decimals; a category not run counts 0, here agent_multi_turn), once with
   the official verdicts and once with the strict ones.

Writes `benchmarks/baselines/acebench_agent_<model>.json` (settings, per-row reports, the figures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from lopd.envs.acebench import AGENT, NORMAL, SPECIAL, ACEBenchConfig, leaderboard_summary
from lopd.envs.acebench_agent import CATEGORY, MODES, ACEBenchAgent, assistant_replies
from lopd.evaluation import evaluate_split
from lopd.models import load_policy
from lopd.schema import ModelConfig

HERE = Path(__file__).resolve().parent
FORMULA = ("0.578 * mean(normal, 12 categories) + 0.2676 * mean(special, 3) + 0.1545 * mean(agent_multi_turn, "
           "agent_multi_step); unweighted means rounded to 3 decimals, a category not run counting 0")


class RecordedAgent(ACEBenchAgent):
    """The env, keeping every scored episode's report (both modes, process scores) and its replies."""

    def __init__(self, config: ACEBenchConfig, nudge: bool):
        super().__init__(config, nudge=nudge)
        self.reports: dict[str, dict] = {}

    def score_episode(self, task, history):
        report = self.report(task, history)
        report["replies"] = [r[:300] for r in assistant_replies(history)]  # for reading, cut at 300 characters
        self.reports[task.id] = report
        return super().score_episode(task, history)


def baseline_categories(path: Path, mode: str) -> dict[str, tuple[int, float]]:
    """{category: (rows, accuracy)} of one scoring mode from a `lopd eval --json` file."""
    data = json.loads(path.read_text())
    out = {}
    for result in data["splits"].values():
        for category, (n, _) in result["per_category"].items():
            out[category] = (n, result["per_category_modes"][mode][category])
    return out


def group_means(results: Mapping[str, tuple[int, float]]) -> dict[str, float]:
    """The released summary's three group means (a category not run counts 0), and the summary itself."""

    def mean(names: Sequence[str]) -> float:
        return round(sum(results.get(n, (0, 0.0))[1] for n in names) / len(names), 3)

    return {"normal": mean(NORMAL), "special": mean(SPECIAL), "agent": mean(AGENT),
            "overall": leaderboard_summary(results)}


def run(model_name: str, baseline: Path, max_turns: int, max_new_tokens: int, batch_size: int,
        max_tasks: int, nudge: bool) -> dict:
    model, tokenizer = load_policy(ModelConfig(name=model_name))
    model.eval()
    env = RecordedAgent(ACEBenchConfig(mode="official"), nudge)
    start = time.perf_counter()
    result = evaluate_split(model, tokenizer, env, CATEGORY, max_tasks=max_tasks, max_new_tokens=max_new_tokens,
                            batch_size=batch_size, max_turns=max_turns)
    seconds = time.perf_counter() - start
    rows = [env.reports[t.id] for t in env.tasks(CATEGORY)[: max_tasks or None]]
    n = len(rows)
    agent = {mode: sum(r["success"][mode] for r in rows) / n for mode in MODES}
    overall = {}
    for mode in MODES:
        combined = {**baseline_categories(baseline, mode), CATEGORY: (n, agent[mode])}
        overall[mode] = group_means(combined)
    baseline_meta = json.loads(baseline.read_text())
    return {
        "model": model_name, "checkpoint": "initial weights", "env": "acebench_agent", "split": CATEGORY,
        "max_turns": max_turns, "max_new_tokens": max_new_tokens, "temperature": 0.0, "nudge": nudge,
        "seconds": round(seconds, 1),
        "agent_multi_step": {
            "n": n, "modes": agent, "env_success": result.success,
            "process": round(sum(r["process"] for r in rows) / n, 3),
            "process_official": round(sum(r["process_official"] for r in rows) / n, 3),
            "mean_turns": round(sum(r["turns"] for r in rows) / n, 2),
        },
        "baseline": {"file": str(baseline.relative_to(HERE.parent) if baseline.is_relative_to(HERE.parent)
                                 else baseline),
                     "max_tasks": baseline_meta.get("max_tasks"),
                     "max_new_tokens": baseline_meta.get("max_new_tokens")},
        "overall": overall, "formula": FORMULA,
        "notes": [
            "agent_multi_turn is not run (its user is an LLM) and counts 0, as a missing category does in the "
            "released summary: it caps the overall figure 0.077 below what a model perfect on it would get.",
            "normal and special come from the baseline file; with max_tasks > 0 they are the first rows of each "
            "category only, and normal_multi_turn categories are per-row means there (the released evaluator "
            "counts whole conversations).",
        ],
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a model folder")
    p.add_argument("--baseline", help="lopd eval --json file with the normal/special categories "
                                      "(default benchmarks/baselines/acebench_<model>.json)")
    p.add_argument("--out", help="output JSON (default benchmarks/baselines/acebench_agent_<model>.json)")
    p.add_argument("--max-turns", type=int, default=20, help="replies per episode (ACEBench: 20)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="longest reply (the baselines used 192)")
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--max-tasks", type=int, default=0, help="first N rows only (0 = all 20)")
    p.add_argument("--nudge", action="store_true", help="answer a reply without calls and go on (ACEBench's loop)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tag = Path(args.model).name
    baseline = Path(args.baseline) if args.baseline else HERE / "baselines" / f"acebench_{tag}.json"
    out = Path(args.out) if args.out else HERE / "baselines" / f"acebench_agent_{tag}.json"
    report = run(args.model, baseline, args.max_turns, args.max_new_tokens, args.batch_size, args.max_tasks,
                 args.nudge)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    step = report["agent_multi_step"]
    print(f"{args.model}: agent_multi_step official {step['modes']['official']:.3f} "
          f"strict {step['modes']['strict']:.3f} "
          f"process {step['process']:.3f} (official {step['process_official']:.3f}), {step['mean_turns']} turns, "
          f"{report['seconds']} s")
    for mode, figures in report["overall"].items():
        print(f"  overall {mode}: {figures['overall']:.3f} (normal {figures['normal']:.3f}, special "
              f"{figures['special']:.3f}, agent {figures['agent']:.3f})")
    print(f"  -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
