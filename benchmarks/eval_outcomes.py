"""What changed between evaluations, problem by problem: the reading behind a flat or noisy learning curve.

A pass@1 of 2 / 82 that moves to 3 / 82 is one problem. This script reads the greedy completions every
evaluation wrote (`samples/<split>_stepNNNNNN.jsonl` in each run directory) and prints, per run and
evaluation point: the problems solved, the success rate with its 95% Wilson interval, how many greedy
completions differ from the step-0 ones (did the policy move at all?), and the most common failure kinds
(the first word of the env's feedback). Between two runs' last evaluations it prints the problems only
one of them solves and McNemar's exact p-value for the difference (paired by problem).

    .venv/bin/python benchmarks/eval_outcomes.py runs/humaneval_smollm2/grpo/seed0 runs/humaneval_smollm2/lopd/seed0
    .venv/bin/python benchmarks/eval_outcomes.py RUN_DIR ... --split test --json out.json

`--gain` instead reads the runs as seeds of one method: each run's first against its last evaluation (tasks
gained and lost, McNemar), then the mean gain with two 95% intervals: Student t over the runs (what another
seed may do) and a paired bootstrap over the tasks, the runs averaged (what another draw of tasks may do).
`--versus REF_RUN ...` does the same for the runs' last evaluations against those of a reference method's
runs of the same seed (paired by directory name): a method's difference from GRPO, seed by seed.

    .venv/bin/python benchmarks/eval_outcomes.py runs/compare_toolworld_smollm2/grpo/seed* --split val --gain
    .venv/bin/python benchmarks/eval_outcomes.py runs/compare_toolworld_smollm2/lopd/seed* --split val \
        --versus runs/compare_toolworld_smollm2/grpo/seed*

Where a run directory goes, a `lopd eval --json` file may go too (its checkpoint's evaluation, from the
`outcomes` it holds): `--versus` pairs the final checkpoints' `test` evaluations by the `seedN` in their names.

    .venv/bin/python benchmarks/eval_outcomes.py eval/lopd_seed*.json --split test --versus eval/grpo_seed*.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
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
    """step -> problem id -> its sample row, for every evaluation of `split` the run wrote; a `lopd eval --json`
    file is one evaluation (step 0) of its checkpoint, from its `outcomes` (no completions)."""
    if run.is_file():
        splits = json.loads(run.read_text()).get("splits", {})
        if split not in splits:
            raise SystemExit(f"{run}: no split '{split}' (it holds {', '.join(splits) or 'none'})")
        if "outcomes" not in splits[split]:
            raise SystemExit(f"{run}: split '{split}' has no 'outcomes' (written by a lopd eval older than 1c13718)")
        return {0: {i: {"id": i, "success": ok, "completion": ""} for i, ok in splits[split]["outcomes"].items()}}
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


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # two-sided t


def paired(pairs: list[tuple[str, dict, dict]], resamples: int = 10_000, seed: int = 0) -> dict:
    """Pairs (label, A, B) of evaluations (problem id -> sample row): per pair the tasks B solves and A not
    ("gained") and the reverse ("lost"), McNemar; then the mean of B - A with two 95% intervals: Student t over
    the pairs (what another seed may do) and a paired bootstrap over the tasks, the pairs averaged (what another
    draw of tasks may do). Success-rate units, over the tasks every evaluation shares."""
    ids = sorted(set.intersection(*(set(a) & set(b) for _, a, b in pairs)))
    if not ids:
        raise SystemExit("the evaluations share no task")
    per_pair = []
    for label, a, b in pairs:
        gained = sum(b[i]["success"] and not a[i]["success"] for i in ids)
        lost = sum(a[i]["success"] and not b[i]["success"] for i in ids)
        per_pair.append({"run": label, "from": sum(a[i]["success"] for i in ids) / len(ids),
                         "to": sum(b[i]["success"] for i in ids) / len(ids), "gained": gained, "lost": lost,
                         "p_mcnemar": mcnemar_exact(gained, lost)})
    diff = {i: statistics.fmean(float(b[i]["success"]) - float(a[i]["success"]) for _, a, b in pairs) for i in ids}
    mean = statistics.fmean(diff.values())
    rng = random.Random(seed)
    boots = sorted(statistics.fmean(diff[rng.choice(ids)] for _ in ids) for _ in range(resamples))
    out = {"tasks": len(ids), "mean_gain": mean,
           "task_bootstrap95": [boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]], "runs": per_pair}
    if len(pairs) > 1:
        gains = [r["to"] - r["from"] for r in per_pair]
        half = T95.get(len(gains) - 1, 1.96) * statistics.stdev(gains) / math.sqrt(len(gains))
        out["seed_t95"] = [mean - half, mean + half]
    return out


def evaluated(run: Path, split: str, at_least: int = 1) -> dict[int, dict[str, dict]]:
    evals = evaluations(run, split)
    if len(evals) < at_least:
        raise SystemExit(f"{run}: fewer than {at_least} evaluation(s) of '{split}'")
    return evals


def gain(runs: list[Path], split: str, resamples: int = 10_000, seed: int = 0) -> dict:
    """The runs as seeds of one method: each run's first vs last evaluation of `split` (`paired`)."""
    pairs = []
    for run in runs:
        evals = evaluated(run, split, 2)
        pairs.append((str(run), evals[min(evals)], evals[max(evals)]))
    return paired(pairs, resamples, seed)


def seed_of(path: Path) -> str:
    """What pairs a run with its reference: the `seedN` its name ends with (a run directory `seed1`, an
    evaluation file `lopd_seed1.json`), else the whole name."""
    found = re.search(r"seed\d+$", path.stem if path.is_file() else path.name)
    return found.group(0) if found else path.name


def versus(runs: list[Path], references: list[Path], split: str, resamples: int = 10_000, seed: int = 0) -> dict:
    """The runs (seeds of one method) against the reference runs of the same seed (`seed_of`: the directory
    `seed1`, or the `lopd eval --json` file `grpo_seed1.json`): each reference's last evaluation of `split` vs
    the run's last (`paired`)."""
    by_seed = {seed_of(ref): ref for ref in references}
    pairs = []
    for run in runs:
        if seed_of(run) not in by_seed:
            raise SystemExit(f"{run}: no reference of '{seed_of(run)}' among {sorted(by_seed)}")
        ref, mine = evaluated(by_seed[seed_of(run)], split), evaluated(run, split)
        pairs.append((f"{run} vs {by_seed[seed_of(run)]}", ref[max(ref)], mine[max(mine)]))
    return paired(pairs, resamples, seed)


def print_paired(g: dict, split: str, what: str) -> None:
    a, b = ("first", "last") if what == "gain" else ("reference", "run")
    print(f"| run | {a} | {b} | gained / lost | exact McNemar p |\n|---|---:|---:|---:|---:|")
    for r in g["runs"]:
        print(f"| {r['run']} | {r['from']:.1%} | {r['to']:.1%} | {r['gained']} / {r['lost']} | {r['p_mcnemar']:.2g} |")
    lo, hi = g["task_bootstrap95"]
    seeds = f", over runs (t) [{g['seed_t95'][0]:+.1%}, {g['seed_t95'][1]:+.1%}]" if "seed_t95" in g else ""
    print(f"\nmean {'gain' if what == 'gain' else 'difference, run - reference,'} on {split} ({g['tasks']} tasks): "
          f"{g['mean_gain']:+.1%}; 95% intervals: over tasks (paired bootstrap) [{lo:+.1%}, {hi:+.1%}]{seeds}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with samples/), or `lopd eval --json` files")
    ap.add_argument("--split", default="test")
    ap.add_argument("--json", type=Path, help="also write everything here")
    ap.add_argument("--gain", action="store_true", help="the runs are seeds of one method: first vs last evaluation")
    ap.add_argument("--versus", nargs="+", type=Path, metavar="REF_RUN",
                    help="the runs are seeds of one method: their last evaluation against these reference runs' "
                         "of the same seed (directory name)")
    args = ap.parse_args()
    if args.gain or args.versus:
        what = "gain" if args.gain else "versus"
        g = gain(args.runs, args.split) if args.gain else versus(args.runs, args.versus, args.split)
        print_paired(g, args.split, what)
        if args.json:
            args.json.write_text(json.dumps({"split": args.split, "comparison": what, **g}, indent=1) + "\n")
        return
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
