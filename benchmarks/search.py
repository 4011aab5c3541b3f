"""The fair configuration search of RESULTS.md section 10: every method gets the same budget of
configurations, chosen on ToolWorld's `val` split (never `test`).

    python benchmarks/search.py                 # run (or resume) both stages, then write the table
    python benchmarks/search.py --report-only   # only the table, from the runs on disk

Stage 1, design: each method's default (lr 3e-4, one pass per batch) and seven one-at-a-time variants of
its own knobs (below), one seed, 1,024 rollouts, `val` evaluated every 256. The best of the eight by
final `val` success (ties: `val` AUC) is the method's design.
Stage 2, optimisation: at that design, policy lr in {1e-4, 3e-4, 1e-3} x `train.epochs_per_batch` in
{1, 2} (the pair already run in stage 1 is not rerun). The best of all thirteen runs is the method's
selected setting. Every run is a normal run directory under runs/search/ (a grid skips finished runs).

Writes benchmarks/search_toolworld.md (the table of all runs, the selected one in bold) and
benchmarks/search_toolworld.json (the selection, which the final grid's configs reproduce).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "src" / "lopd" / "configs"
OUT = Path("runs/search")
BUDGET, EVAL_EVERY = 1024, 256
COMMON = ["env.eval_splits=[val]", "eval.max_tasks=200"]

SELF_DISTILLATION_VARIANTS = {  # the text self-distillation methods share their knobs
    "topk": ["algorithm.distill.estimator=topk"],
    "sampled": ["algorithm.distill.estimator=sampled"],
    "jsd": ["algorithm.distill.estimator=jsd", "algorithm.distill.alpha=0.5"],
    "ema": ["algorithm.distill.teacher=ema"],
    "live": ["algorithm.distill.teacher=live"],
    "pg1": ["algorithm.distill.pg_weight=1.0"],
    "sequence": ["algorithm.aggregation=sequence"],
}
VARIANTS = {
    "grpo": {
        "kl0.02": ["algorithm.pg.kl_coef=0.02"],
        "kl0.005": ["algorithm.pg.kl_coef=0.005"],
        "drgrpo": ["algorithm.pg.normalize_std=false"],
        "cliphigh": ["algorithm.pg.clip_high=0.28"],
        "sequence": ["algorithm.aggregation=sequence"],
        "noclip": ["optim.grad_clip=0.0"],
        "warmup": ["optim.warmup_steps=4"],
    },
    "opsd": SELF_DISTILLATION_VARIANTS,
    "sdpo": SELF_DISTILLATION_VARIANTS,
    "skill_sd": SELF_DISTILLATION_VARIANTS,
    "lopd": {
        "prefix": ["algorithm.lopd.position=prefix"],
        "privilege": ["algorithm.lopd.objective=privilege"],
        "dual": ["algorithm.lopd.dual_lr=1.0"],
        "passes": ["algorithm.lopd.composer_passes=1"],
        "warmup": ["algorithm.lopd.composer_warmup_steps=2"],
        "clr3e-3": ["algorithm.lopd.composer_lr=3e-3"],
        "pg1": ["algorithm.distill.pg_weight=1.0"],
    },
}
LRS, EPOCHS = (1e-4, 3e-4, 1e-3), (1, 2)


def grid_file(name: str, methods: dict[str, list[str]], configs: dict[str, str]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "out": str(OUT / name), "budget": BUDGET, "eval_every": EVAL_EVERY, "seeds": [0],
        "base": str(CONFIGS / "demo.yaml"), "overrides": COMMON, "workers": 2, "threads_per_worker": 1,
        "reference": "grpo", "methods": {m: {"config": configs[m], "overrides": o} for m, o in methods.items()}},
        sort_keys=False))
    return path


def final_and_auc(run_dir: Path) -> tuple[float, float] | None:
    from lopd.runs import RunDir

    if not (run_dir / "finished").is_file():
        return None
    pts = [(r["rollouts"], r["eval/val/success"]) for r in RunDir(run_dir).read_metrics() if "eval/val/success" in r]
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    return pts[-1][1], area / max(pts[-1][0] - pts[0][0], 1)


def run(path: Path) -> None:
    from lopd.compare import load_grid, run_grid

    run_grid(load_grid(path))


def stage1(methods: list[str]) -> dict[str, list[str]]:
    out = {}
    for m in methods:
        out[f"{m}@default"] = []
        for v, o in VARIANTS[m].items():
            out[f"{m}@{v}"] = o
    return out


def best(results: dict[str, tuple[float, float] | None], prefix: str) -> str:
    mine = {k: v for k, v in results.items() if k.split("@")[0] == prefix and v is not None}
    return max(mine, key=lambda k: (mine[k][0], mine[k][1]))


def design_of(key: str, stage1_methods: dict[str, list[str]]) -> list[str]:
    return stage1_methods[key]


def stage2(selected: dict[str, str], stage1_methods: dict[str, list[str]]) -> dict[str, list[str]]:
    out = {}
    for m, key in selected.items():
        design = design_of(key, stage1_methods)
        for lr in LRS:
            for ep in EPOCHS:
                if lr == 3e-4 and ep == 1:
                    continue  # run in stage 1
                out[f"{key}+lr{lr:g}+ep{ep}"] = design + [f"optim.lr={lr}", f"train.epochs_per_batch={ep}"]
    return out


def results_of(grid: str, methods: dict) -> dict[str, tuple[float, float] | None]:
    return {k: final_and_auc(OUT / grid / k / "seed0") for k in methods}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--methods", nargs="+", default=list(VARIANTS))
    args = p.parse_args()
    configs = {m: str(CONFIGS / f"{m}.yaml") for m in args.methods}
    s1 = stage1(args.methods)
    path1 = grid_file("stage1", s1, {k: configs[k.split("@")[0]] for k in s1})
    if not args.report_only:
        run(path1)
    r1 = results_of("stage1", s1)
    selected_design = {m: best(r1, m) for m in args.methods if any(r1[k] for k in r1 if k.startswith(m + "@"))}
    s2 = stage2(selected_design, s1)
    path2 = grid_file("stage2", s2, {k: configs[k.split("@")[0]] for k in s2})
    if not args.report_only:
        run(path2)
    r2 = results_of("stage2", s2)
    every = {**r1, **r2}
    chosen, rows = {}, []
    for m in args.methods:
        mine = {k: v for k, v in every.items() if k.split("@")[0] == m and v is not None}
        if not mine:
            continue
        top = max(mine, key=lambda k: (mine[k][0], mine[k][1]))
        design_key = top.split("+")[0]
        overrides = design_of(design_key, s1) + [o for o in s2.get(top, []) if o.startswith(("optim.lr", "train.epochs"))]
        chosen[m] = {"run": top, "val_final": mine[top][0], "val_auc": mine[top][1], "overrides": overrides,
                     "configurations": len(mine)}
        for k in sorted(mine, key=lambda k: (-mine[k][0], -mine[k][1])):
            rows.append((m, k, mine[k], k == top))
    (ROOT / "benchmarks" / "search_toolworld.json").write_text(json.dumps(chosen, indent=1))
    lines = ["| method | configuration | val success at 1,024 (%) | val AUC (%) |", "|---|---|---:|---:|"]
    for m, k, (final, auc), top in rows:
        cell = k.split("@", 1)[1]
        lines.append(f"| {m} | {'**' + cell + '**' if top else cell} | {'**' if top else ''}{100 * final:.1f}"
                     f"{'**' if top else ''} | {100 * auc:.1f} |")
    (ROOT / "benchmarks" / "search_toolworld.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(chosen, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
