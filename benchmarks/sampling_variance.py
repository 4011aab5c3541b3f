"""Which sampling temperature gives a policy's groups reward variance? Measured on `train`, never `test`.

GRPO's advantages (and LOPD's privilege, and the experience bank's successes) exist only in groups
where some samples pass and some fail: a group that all fails (or all passes) carries no signal. This
script samples `rollout.group_size` completions for each of N `train` tasks at each temperature, scores
them with the env (HumanEval: the sandbox's parallel path), and reports per temperature the success
rate, the fraction of mixed groups, the tasks solved at least once, truncation and time. The chosen
temperature is the one with the most mixed groups, ties broken by the larger summed group variance
sum_g p_g (1 - p_g) (p_g: group g's pass rate; the expected squared advantage before GRPO's std
normalisation, so a group of 7 passes in 8 counts less than one of 4 in 8); `test` is never touched.

    .venv/bin/python benchmarks/sampling_variance.py --config configs/humaneval_smollm2.yaml \
        --temperatures 0.4 0.7 1.0 --tasks 24 --out benchmarks/humaneval_temperature.json

Resumable: a temperature already in --out is skipped (delete the file, or pass --redo, to re-measure).
Each temperature samples under a seed derived from --seed and the temperature itself, so adding a
temperature never changes the other rows.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

import torch


def measure(model, tokenizer, env, tasks, cfg, temperature: float, seed: int) -> dict:
    from lopd.rollout import sample_and_score

    g = cfg.rollout.group_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + round(temperature * 1000))
        start = time.perf_counter()
        batch = sample_and_score(model, tokenizer, env, tasks, group_size=g, temperature=temperature,
                                 top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
                                 batch_size=cfg.rollout.batch_size, max_turns=cfg.rollout.max_turns)
        seconds = time.perf_counter() - start
    passed = batch.success.view(len(tasks), g)  # [N, G]
    per_group = passed.sum(-1)  # [N]
    mixed = ((per_group > 0) & (per_group < g))
    return {
        "temperature": temperature,
        "tasks": len(tasks),
        "group_size": g,
        "samples": len(batch),
        "success": float(batch.success.float().mean()),
        "mixed_groups": int(mixed.sum()),
        "mixed_fraction": float(mixed.float().mean()),
        "all_pass_groups": int((per_group == g).sum()),
        "solved_at_least_once": int((per_group > 0).sum()),
        "passes_per_task": {t.id: int(c) for t, c in zip(tasks, per_group)},
        "truncated": float(batch.truncated.float().mean()),
        "mean_completion_tokens": float(batch.completion_mask.sum(-1).float().mean()),
        "seconds": round(seconds, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def group_variance(row: dict) -> float:
    g = row["group_size"]
    return sum((c / g) * (1 - c / g) for c in row["passes_per_task"].values())


def chosen(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: (r["mixed_groups"], group_variance(r)))


def table(rows: list[dict]) -> str:
    lines = ["| temperature | samples | success | mixed groups | sum of group variance | all-pass groups "
             "| tasks solved once+ | truncated | mean tokens | seconds |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["temperature"]):
        lines.append(f"| {r['temperature']:g} | {r['samples']} | {100 * r['success']:.1f}% | {r['mixed_groups']} / "
                     f"{r['tasks']} | {group_variance(r):.3f} | {r['all_pass_groups']} | {r['solved_at_least_once']} | "
                     f"{100 * r['truncated']:.0f}% | {r['mean_completion_tokens']:.0f} | {r['seconds']:.0f} |")
    if rows:
        lines.append(f"\nchosen: temperature {chosen(rows)['temperature']:g} (most mixed groups, then group variance)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the training config (model, env, rollout sizes)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.4, 0.7, 1.0])
    p.add_argument("--tasks", type=int, default=24, help="train tasks, a seeded sample of the split")
    p.add_argument("--split", default="", help="default: the config's env.train_split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON of the rows (resumable)")
    p.add_argument("--redo", action="store_true", help="re-measure temperatures already in --out")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = p.parse_args(argv)

    from lopd.config import load_config
    from lopd.envs import build_env
    from lopd.models import pick_device
    from lopd.session import env_tasks
    from lopd.models import load_policy

    cfg = load_config(args.config, args.overrides)
    split = args.split or cfg.env.train_split
    if split in cfg.env.eval_splits:
        print(f"error: {split!r} is an evaluation split of {args.config}; choose sampling settings on train",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    done = {r["temperature"] for r in rows}
    todo = [t for t in args.temperatures if args.redo or t not in done]
    rows = [r for r in rows if r["temperature"] not in todo]
    if not todo:
        print(table(rows))
        return 0
    env = build_env(cfg.env)
    tasks = list(env_tasks(env, split, "train_split"))
    tasks = random.Random(args.seed).sample(tasks, min(args.tasks, len(tasks)))
    model, tokenizer = load_policy(cfg.model, pick_device(cfg.train.device))
    for t in todo:
        row = measure(model, tokenizer, env, tasks, cfg, t, args.seed)
        rows.append(row)
        out.write_text(json.dumps({"config": args.config, "split": split, "overrides": args.overrides,
                                   "rows": sorted(rows, key=lambda r: r["temperature"])}, indent=1) + "\n")
        print(f"T={t:g}: success {100 * row['success']:.1f}%, mixed groups {row['mixed_groups']}/{row['tasks']}, "
              f"truncated {100 * row['truncated']:.0f}%, {row['seconds']:.0f} s", flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
