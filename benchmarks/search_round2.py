"""The second fair search (issue 30, RESULTS.md section 17): the retrieval keys and distillation targets the
privilege probe pointed to, and LOPD's compressor, chosen on ToolWorld's `val` split (never `test`), with
the same budget for every method, in two stages:

    stage 1   each method's round-1 selection (benchmarks/search_toolworld.json, already in its config file)
              and six variants of it, seed 0, 1,024 rollouts, `val` evaluated every 256
    stage 2   each method's two best configurations of stage 1 (final `val`, ties: `val` AUC) again on seed 1
    selected  the finalist with the higher mean final `val` over seeds 0 and 1 (ties: the mean AUC)

Seed 1 is needed because every round-1 selection was itself chosen on seed 0, so on seed 0 alone the base
configurations carry their selection's luck. Every method runs 7 + 2 runs.

    python benchmarks/search_round2.py                   # run (or resume) both stages, then write the table
    python benchmarks/search_round2.py --report-only     # the table from the runs on disk
    python benchmarks/search_round2.py --methods lopd    # one method's runs

Every run is a normal run directory under runs/search2/ (a grid skips finished runs); stage 1's runs whose
directories were lost are read from benchmarks/search_round2_stage1.json (RESULTS 17b's figures) instead of
being run again. Writes benchmarks/search_round2.md and benchmarks/search_round2.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "src" / "lopd" / "configs"
OUT = Path("runs/search2")
BUDGET, EVAL_EVERY = 1024, 256
COMMON = ["env.eval_splits=[val]", "eval.max_tasks=200"]

RESIDUAL = ["algorithm.distill.target=residual"]
GATED = ["algorithm.distill.target=gated", "algorithm.distill.gate_threshold=0.05"]
TEXT_TARGETS = {  # OPSD and SDPO: the targets and the teacher's weights
    "gated": GATED,
    "gated0.2": ["algorithm.distill.target=gated", "algorithm.distill.gate_threshold=0.2"],
    "residual": RESIDUAL,
    "residual_b2": RESIDUAL + ["algorithm.distill.residual_beta=2.0"],
    "ema": ["algorithm.distill.teacher=ema"],
    "live": ["algorithm.distill.teacher=live"],
}
RETRIEVAL = {  # Skill-SD and lopd_text: the retrieval keys, the targets, and both
    "task_tools": ["algorithm.retrieval.key=task_tools"],
    "category": ["algorithm.retrieval.key=category"],
    "gated": GATED,
    "residual": RESIDUAL,
    "task_tools+residual": ["algorithm.retrieval.key=task_tools"] + RESIDUAL,
    "category+residual": ["algorithm.retrieval.key=category"] + RESIDUAL,
}
COMPRESSOR = ["algorithm.lopd.composer=compressor", "algorithm.lopd.latent_tokens=16", "algorithm.lopd.retrieve_k=2",
              "algorithm.lopd.beta=0.0", "algorithm.lopd.composer_lr=1e-3", "algorithm.retrieval.key=task_tools"]
# The compressor pre-trained before RL (`lopd pretrain-compressor --out runs/compressor --steps 600`, RESULTS 17e),
# read from the first step (no warm-up on the text teacher): stage 1's compressor runs above never left their
# warm-up (RESULTS 17b), so they measured `lopd_text`, not the latent teacher; these five replace them.
PRETRAINED = COMPRESSOR + ["algorithm.lopd.compressor_init=runs/compressor/compressor.pt",
                           "algorithm.lopd.latent_from_kl_ratio=inf"]
VARIANTS = {
    "grpo": {
        "lr2e-4": ["optim.lr=2e-4"],
        "lr5e-4": ["optim.lr=5e-4"],
        "cliphigh": ["algorithm.pg.clip_high=0.28"],
        "drgrpo": ["algorithm.pg.normalize_std=false"],
        "minibatch2": ["train.minibatches=2"],
        "token": ["algorithm.aggregation=token"],
    },
    "opsd": TEXT_TARGETS,
    "sdpo": TEXT_TARGETS,
    "skill_sd": RETRIEVAL,
    "lopd_text_experiences": RETRIEVAL,
    "lopd": {
        "pretrained": PRETRAINED,  # the compressor goes on learning in RL: context distillation + the margin
        "pretrained+frozen": PRETRAINED + ["algorithm.lopd.train_composer=false"],  # as pre-trained: no composer pass
        "pretrained+residual": PRETRAINED + RESIDUAL,
        "pretrained+gated": PRETRAINED + GATED,
        "pretrained+category": PRETRAINED + ["algorithm.retrieval.key=category"],
        "resampler+task_tools+residual": ["algorithm.retrieval.key=task_tools"] + RESIDUAL,
    },
}
# stage 1's runs whose directories were lost with a machine (2026-12-04): their figures as RESULTS 17b records
# them, so that stage 2 can pick its finalists (final `val`, then AUC, seed 0)
RECORDED = ROOT / "benchmarks" / "search_round2_stage1.json"


def grid_file(methods: dict[str, tuple[str, list[str]]], seeds: list[int]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "grid.yaml"
    path.write_text(yaml.safe_dump({
        "name": "search2", "out": str(OUT), "budget": BUDGET, "eval_every": EVAL_EVERY, "seeds": seeds,
        "base": str(CONFIGS / "demo.yaml"), "overrides": COMMON, "workers": 2, "threads_per_worker": 1,
        "reference": "grpo@base" if "grpo@base" in methods else next(iter(methods)), "methods": {m: {"config": c, "overrides": o} for m, (c, o) in methods.items()}},
        sort_keys=False))
    return path


def curve(run_dir: Path) -> list[tuple[int, float]] | None:
    from lopd.runs import RunDir

    run = RunDir(run_dir)
    if not run.finished():
        return None
    return [(r["rollouts"], r["eval/val/success"]) for r in run.read_metrics() if "eval/val/success" in r]


def figures(points: list[tuple[int, float]]) -> dict[str, float]:
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))
    at = dict(points)
    return {"final": points[-1][1], "at512": at.get(512, float("nan")), "auc": area / max(points[-1][0] - points[0][0], 1)}


def finished_figures(key: str, seed: int) -> dict[str, float] | None:
    """A finished run's figures: from its run directory, else (seed 0) as recorded in RECORDED."""
    points = curve(OUT / key / f"seed{seed}")
    if points:
        return figures(points)
    recorded = json.loads(RECORDED.read_text()) if RECORDED.is_file() else {}
    return recorded.get(key) if seed == 0 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--methods", nargs="+", default=list(VARIANTS))
    p.add_argument("--finalists", type=int, default=2, help="configurations per method that stage 2 reruns")
    args = p.parse_args()
    runs = {}
    for m in args.methods:
        config = str(CONFIGS / f"{m}.yaml")
        runs[f"{m}@base"] = (config, [])
        runs.update({f"{m}@{v}": (config, o) for v, o in VARIANTS[m].items()})
    if not args.report_only:
        from lopd.compare import load_grid, run_grid

        todo = {k: v for k, v in runs.items() if finished_figures(k, 0) is None}  # neither on disk nor recorded
        if todo:
            run_grid(load_grid(grid_file(todo, [0])))
    first = {k: f for k in runs if (f := finished_figures(k, 0)) is not None}
    finalists = {}
    for m in args.methods:
        mine = sorted((k for k in first if k.split("@")[0] == m), key=lambda k: (-first[k]["final"], -first[k]["auc"]))
        if len(mine) == len([k for k in runs if k.split("@")[0] == m]):  # stage 1 complete for this method
            finalists.update({k: runs[k] for k in mine[: args.finalists]})
    if finalists and not args.report_only:
        from lopd.compare import load_grid, run_grid

        run_grid(load_grid(grid_file(finalists, [1])))
    second = {k: f for k in finalists if (f := finished_figures(k, 1)) is not None}
    chosen, lines = {}, ["| method | configuration | val at 512, seed 0 (%) | val at 1,024, seed 0 | seed 1 | "
                         "mean of 2 | val AUC, seed 0 |", "|---|---|---:|---:|---:|---:|---:|"]
    for m in args.methods:
        mine = sorted((k for k in first if k.split("@")[0] == m), key=lambda k: (-first[k]["final"], -first[k]["auc"]))
        done = [k for k in mine if k in second]
        mean = {k: {x: (first[k][x] + second[k][x]) / 2 for x in ("final", "auc")} for k in done}
        top = max(done, key=lambda k: (mean[k]["final"], mean[k]["auc"])) if done and len(done) == len(
            [k for k in finalists if k.split("@")[0] == m]) else None
        if top:
            chosen[m] = {"run": top, "overrides": runs[top][1], "final_mean": mean[top]["final"],
                         "auc_mean": mean[top]["auc"], "per_seed_final": [first[top]["final"], second[top]["final"]],
                         "configurations": len(mine)}
        for k in mine:
            r, cell, bold = first[k], k.split("@", 1)[1], "**" if k == top else ""
            s1 = f"{100 * second[k]['final']:.1f}" if k in second else ""
            both = f"{bold}{100 * mean[k]['final']:.1f}{bold}" if k in mean else ""
            lines.append(f"| {m} | {bold}{cell}{bold} | {100 * r['at512']:.1f} | {100 * r['final']:.1f} | {s1} | "
                         f"{both} | {100 * r['auc']:.1f} |")
    (ROOT / "benchmarks" / "search_round2.json").write_text(json.dumps(chosen, indent=1))
    (ROOT / "benchmarks" / "search_round2.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
