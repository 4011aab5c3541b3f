"""Benchmark: one method's training step at a real model's shape, on whatever device is there.

The weights of Qwen3-0.6B/8B are not on this machine (nothing downloads), so the model is a randomly
initialised backbone of the same shape (layers, widths, heads, the 151,936-token head) with the bundled
tokenizer: rewards are meaningless, but every code path (LoRA, bf16, sampling with a KV cache, the
frozen/latent teacher, chunked full-vocabulary KL, the composer) runs at that size, and the per-phase
times and peak memory are real. Completions run to `max_new_tokens` (a random model rarely stops).

    python benchmarks/scale_smoke.py --method lopd --shape qwen3-0.6b --device cuda
    python benchmarks/scale_smoke.py --method grpo --shape small --device cpu --steps 2    # quick check
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "small": (64, 2, 4, 2, 128, 151936),
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, 151936),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144, 151936),
    "qwen3-8b": (4096, 36, 32, 8, 12288, 151936),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="lopd", help="a bundled algorithm config (grpo, opsd, sdpo, skill_sd, lopd)")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=8, help="tasks per step")
    ap.add_argument("--group", type=int, default=8, help="samples per task")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--work", default="", help="folder for the model and the run (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()

    from lopd.config import config_path, load_config
    from lopd.loop import train
    from lopd.models import save_random_backbone
    from lopd.runs import RunDir

    work = Path(args.work or tempfile.mkdtemp(prefix="lopd-scale-"))
    hidden, layers, heads, kv, inter, vocab = SHAPES[args.shape]
    folder = work / f"model-{args.shape}"
    if not (folder / "config.json").is_file():
        start = time.perf_counter()
        save_random_backbone(folder, "qwen3", hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
                             intermediate=inter, vocab=vocab)
        print(f"random {args.shape} written to {folder} in {time.perf_counter() - start:.0f} s")
    per_step = args.tasks * args.group
    run_dir = work / f"run-{args.method}-{args.shape}"
    cfg = load_config(config_path(args.method), [
        f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false", f"model.name={folder}",
        "model.dtype=bfloat16", "model.lora.enabled=true", "model.lora.r=16", "model.lora.alpha=32",
        f"rollout.tasks_per_step={args.tasks}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.batch_size={per_step}",
        f"train.max_rollouts={per_step * args.steps}", f"train.device={args.device}", "train.micro_batch_size=16",
        "eval.every_rollouts=0", "eval.max_tasks=8", "optim.lr=1e-5", *args.overrides,
        *(["algorithm.retrieval.embedder=backbone"] if args.method == "lopd" else [])])
    start = time.perf_counter()
    train(cfg, quiet=True)
    total = time.perf_counter() - start
    rows = [r for r in RunDir(run_dir).read_metrics() if r["kind"].startswith("train")]
    later = rows[1:] or rows  # the first step includes warm-up
    print(f"\n{args.method} on a random {args.shape} (Qwen3 shape, bf16, LoRA r=16), {args.device}: "
          f"{args.steps} steps of {args.tasks} x {args.group} rollouts, <= {args.max_new_tokens} new tokens; "
          f"run total {total:.0f} s (model load and the step-0 evaluation included)")
    print("| phase | seconds per step (median of steps 2..) |\n|---|---:|")
    for key in sorted({k for r in later for k in r if k.startswith("time/")}):
        print(f"| {key[5:]} | {statistics.median(r.get(key, 0.0) for r in later):.2f} |")
    if "memory/peak_gib" in rows[-1]:
        print(f"| peak GPU memory (GiB) | {max(r['memory/peak_gib'] for r in rows):.1f} |")
    print(f"| tokens per step | {statistics.median(r['rollout/length'] for r in later) * per_step:.0f} |")
    losses = {k: rows[-1][k] for k in rows[-1] if k.startswith("loss/")}
    print("last step:", {k: round(v, 4) for k, v in losses.items()}, "(finite)" if all(
        v == v and abs(v) != float("inf") for v in losses.values()) else "(NOT FINITE)")


if __name__ == "__main__":
    main()
