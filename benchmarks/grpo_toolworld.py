"""Benchmark: GRPO with the bundled tiny policy on ToolWorld, held-out success against rollouts.

Trains one run per seed with the demo's settings (configs/demo.yaml unless --config is given), then
prints a markdown table of held-out success (greedy, `test` and `transfer`) at every evaluation point,
mean +- std over seeds, plus the mean seconds per step of each phase. Paste it into RESULTS.md.

    python benchmarks/grpo_toolworld.py --seeds 0 1 2 --out runs/bench_grpo
    python benchmarks/grpo_toolworld.py --config configs/grpo.yaml train.max_rollouts=4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from lopd.cli import config_path
from lopd.config import load_config
from lopd.runs import RunDir
from lopd.train import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="demo")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="runs/bench_grpo")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    curves: dict[int, dict[int, dict[str, float]]] = {}
    phases: dict[str, list[float]] = {}
    wall = {}
    for seed in args.seeds:
        run_dir = Path(args.out) / f"seed{seed}"
        cfg = load_config(config_path(args.config), args.overrides + [f"train.seed={seed}", f"run.dir={run_dir}"])
        start = time.perf_counter()
        train(cfg)
        wall[seed] = time.perf_counter() - start
        rows = RunDir(run_dir).read_metrics()
        curves[seed] = {r["rollouts"]: {k.split("/")[1]: v for k, v in r.items() if k.startswith("eval/") and k.endswith("/success")}
                        for r in rows if any(k.startswith("eval/") for k in r)}
        for r in rows:
            if r.get("kind", "").startswith("train"):
                for k, v in r.items():
                    if k.startswith("time/"):
                        phases.setdefault(k, []).append(v)

    budgets = sorted(set.intersection(*(set(c) for c in curves.values())))
    splits = sorted({s for c in curves.values() for point in c.values() for s in point})
    print(f"\nGRPO, tiny policy, ToolWorld; seeds {args.seeds}; config {args.config} {' '.join(args.overrides)}\n")
    print("| rollouts | " + " | ".join(f"{s} success % (mean ± std)" for s in splits) + " |")
    print("|---:|" + "---:|" * len(splits))
    table = {}
    for b in budgets:
        cells = []
        for s in splits:
            vals = [100 * curves[seed][b][s] for seed in args.seeds]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.1f} ± {sd:.1f}")
            table.setdefault(str(b), {})[s] = vals
        print(f"| {b} | " + " | ".join(cells) + " |")
    print("\n| phase | seconds per step (median over steps and seeds) |\n|---|---:|")
    for k, v in sorted(phases.items()):
        print(f"| {k.removeprefix('time/')} | {statistics.median(v):.2f} |")
    print(f"\nwall-clock per run: {', '.join(f'seed {s}: {w / 60:.1f} min' for s, w in wall.items())}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps({"table": table, "wall_s": wall,
                                                              "phases_median_s": {k: statistics.median(v) for k, v in phases.items()}}, indent=1))


if __name__ == "__main__":
    main()
