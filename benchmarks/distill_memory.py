"""Benchmark: peak memory and time of the distillation loss stage, chunked against naive.

The loss stage takes the student's and the teacher's final hidden states at B x T completion positions
([B, T, H]) and their output heads (H -> V), and computes the full-vocabulary reverse KL per token,
its mean, and the backward pass into the student's hidden states and head.

    naive    logits and log-softmax of both models materialised as [B, T, V] float32 tensors at once
    chunked  lopd.tokens.token_divergence: one [B, chunk, V] block per model at a time, recomputed in
             the backward pass (activation checkpointing)

Each variant runs in a fresh subprocess; peak memory is the process's peak resident set size minus its
resident size just before the stage (inputs and weights already allocated). Medians over repeats.

    python benchmarks/distill_memory.py                                   # the RESULTS.md table
    python benchmarks/distill_memory.py --vocab 49152 --tokens 8x1024 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
from lopd.tokens import TokenStats, token_divergence

variant, B, T, H, V, chunk, limit_gb = sys.argv[1], *map(int, sys.argv[2:8])
import resource
resource.setrlimit(resource.RLIMIT_AS, (limit_gb << 30, limit_gb << 30))  # fail with MemoryError, never OOM the box
torch.manual_seed(0)
torch.set_num_threads(2)
s_head = torch.nn.Linear(H, V, bias=False)
t_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
s_hidden = torch.randn(B, T, H, requires_grad=True)
t_hidden = torch.randn(B, T, H)
mask = torch.ones(B, T)
targets = torch.zeros(B, T, dtype=torch.long)

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))

base = rss_kb()
start = time.perf_counter()
if variant == "naive":
    ls = torch.log_softmax(s_head(s_hidden).float(), -1)        # [B, T, V]
    lt = torch.log_softmax(t_head(t_hidden).float(), -1)        # [B, T, V]
    kl = (ls.exp() * (ls - lt)).sum(-1)
else:
    s = TokenStats(s_hidden, s_head, targets, mask, chunk=chunk)
    t = TokenStats(t_hidden, t_head, targets, mask, chunk=chunk)
    kl = token_divergence(s, t, "full")
loss = kl.mean()
loss.backward()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB
print(json.dumps({"seconds": seconds, "peak_mb": (peak - base) / 1024, "loss": loss.item()}))
"""


def run(variant: str, B: int, T: int, H: int, V: int, chunk: int, limit_gb: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, variant, str(B), str(T), str(H), str(V), str(chunk), str(limit_gb)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--tokens", default="8x1024", help="B x T")
    ap.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit-gb", type=int, default=20, help="address-space cap per run (a larger need fails cleanly)")
    args = ap.parse_args()
    B, T = map(int, args.tokens.split("x"))
    print(f"B x T = {B} x {T}, H = {args.hidden}, chunk = {args.chunk}, {args.repeats} repeats, float32, CPU\n")
    print("| vocab | variant | peak MB (median) | seconds (median) | peak vs naive | time vs naive |")
    print("|---:|---|---:|---:|---:|---:|")
    for V in args.vocab:
        results = {}
        for variant in ("naive", "chunked"):
            runs = []
            for _ in range(args.repeats):  # interleaved order would be fairer on a noisy box; runs are long
                runs.append(run(variant, B, T, args.hidden, V, args.chunk, args.limit_gb))
            ok = [r for r in runs if "error" not in r]
            results[variant] = ({"peak_mb": statistics.median(r["peak_mb"] for r in ok),
                                 "seconds": statistics.median(r["seconds"] for r in ok), "loss": ok[0]["loss"]}
                                if ok else {"error": runs[0]["error"]})
        n, c = results["naive"], results["chunked"]
        for variant, r in results.items():
            if "error" in r:
                print(f"| {V} | {variant} | failed: {r['error'][:60]} | | | |")
                continue
            ratio_m = f"{r['peak_mb'] / n['peak_mb']:.2f}" if "error" not in n else "-"
            ratio_t = f"{r['seconds'] / n['seconds']:.2f}" if "error" not in n else "-"
            print(f"| {V} | {variant} | {r['peak_mb']:.0f} | {r['seconds']:.2f} | {ratio_m} | {ratio_t} |")
        if "error" not in n and "error" not in c:
            assert abs(n["loss"] - c["loss"]) < 1e-4 * max(1.0, abs(n["loss"])), "variants disagree"


if __name__ == "__main__":
    main()
