"""What changed between evaluations, problem by problem: the reading behind a flat or noisy learning curve.

A pass@1 of 2 / 82 that moves to 3 / 82 is one problem. This script reads the greedy completions every
evaluation wrote (`samples/<split>_stepNNNNNN.jsonl` in each run directory) and prints, per run and
evaluation point: the problems solved, the success rate with its 95% Wilson interval, how many greedy
completions differ from the step-0 ones (did the policy move at all?), and the most common failure kinds
(the first word of the env's feedback). Between two runs' last evaluations it prints the problems only
one of them solves and McNemar's exact p-value for the difference (paired by problem).

    .venv/bin/python benchmarks/eval_outcomes.py runs/humaneval_smollm2/grpo/seed0 runs/humaneval_smollm2/lopd/seed0
    .venv/bin/python benchmarks/eval_outcomes.py RUN_DIR ... --split test --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from pathlib import Path


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for k successes in n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs under Binomial(n, 1/2)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def evaluations(run: Path, split: str) -> dict[int, dict[str, dict]]:
    """step -> problem id -> its sample row, for every evaluation of `split` the run wrote."""
    out = {}
    for path in sorted((run / "samples").glob(f"{split}_step*.jsonl")):
        step = int(re.search(r"step(\d+)", path.name).group(1))
        out[step] = {row["id"]: row for row in map(json.loads, path.read_text().splitlines())}
    return out


def failure_kind(feedback: str) -> str:
    return (feedback or "no feedback").split(":")[0].split(" at ")[0][:40]


def summarise(run: Path, split: str) -> list[dict]:
    evals = evaluations(run, split)
    if not evals:
        raise SystemExit(f"{run}: no samples/{split}_step*.jsonl (was the run evaluated on '{split}'?)")
    first = evals[min(evals)]
    rows = []
    for step, rows_by_id in evals.items():
        solved = sorted(i for i, r in rows_by_id.items() if r["success"])
        n = len(rows_by_id)
        low, high = wilson(len(solved), n)
        kinds = Counter(failure_kind(r.get("feedback", "")) for r in rows_by_id.values() if not r["success"])
        rows.append({"step": step, "n": n, "solved": solved, "success": len(solved) / n, "ci95": [low, high],
                     "changed_since_first": sum(first[i]["completion"] != r["completion"]
                                                for i, r in rows_by_id.items() if i in first),
                     "failures": dict(kinds.most_common(5))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with samples/)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--json", type=Path, help="also write everything here")
    args = ap.parse_args()
    report = {str(run): summarise(run, args.split) for run in args.runs}
    for run, rows in report.items():
        print(f"\n{run} ({args.split})")
        print("| step | solved | success (95% CI) | greedy completions changed since the first | failures |")
        print("|---:|---|---|---:|---|")
        for r in rows:
            kinds = ", ".join(f"{k} {v}" for k, v in r["failures"].items())
            print(f"| {r['step']} | {len(r['solved'])}: {' '.join(s.split('/')[-1] for s in r['solved'])} | "
                  f"{r['success']:.1%} ({r['ci95'][0]:.1%}-{r['ci95'][1]:.1%}) | {r['changed_since_first']} / {r['n']} "
                  f"| {kinds} |")
    pairs = []
    names = list(report)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            last_a, last_b = set(report[a][-1]["solved"]), set(report[b][-1]["solved"])
            pair = {"a": a, "b": b, "only_a": sorted(last_a - last_b), "only_b": sorted(last_b - last_a),
                    "p_mcnemar": mcnemar_exact(len(last_a - last_b), len(last_b - last_a))}
            pairs.append(pair)
            print(f"\nlast evaluations, {a} vs {b}: only the first solves {pair['only_a'] or 'none'}, "
                  f"only the second {pair['only_b'] or 'none'}; exact McNemar p = {pair['p_mcnemar']:.3g}")
    if args.json:
        args.json.write_text(json.dumps({"split": args.split, "runs": report, "pairs": pairs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
