"""Benchmark: peak memory and time of the distillation loss stage, chunked against naive.

The loss stage takes the student's and the teacher's final hidden states at B x T completion positions
([B, T, H]) and their output heads (H -> V), and computes the full-vocabulary reverse KL per token,
its mean, and the backward pass into the student's hidden states and head.

    naive    logits and log-softmax of both models materialised as [B, T, V] float32 tensors at once
    chunked  lopd.tokens.token_divergence: one [B, chunk, V] block per model at a time; with a frozen
             student head (LoRA) the per-token hidden-state gradients are taken in the forward pass,
             with a trained one (full fine-tune) each chunk is recomputed in the backward pass

Each variant runs in a fresh subprocess. On the CPU, peak memory is the process's peak resident set
size minus its resident size just before the stage (inputs and weights already allocated); on a GPU
(`--device cuda`) it is torch's peak allocated device memory minus what was allocated before the
stage, after one warm-up pass, and the repeats are synchronised passes in one process. Medians over repeats.

    python benchmarks/distill_memory.py                                   # the RESULTS.md CPU table
    python benchmarks/distill_memory.py --vocab 49152 --tokens 8x1024 --repeats 3
    python benchmarks/distill_memory.py --device cuda --hidden 4096 --dtype bfloat16   # Qwen3-8B-sized, GPU
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

variant, device, dtype, heads = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3]), sys.argv[4]
B, T, H, V, chunk, limit_gb, repeats = map(int, sys.argv[5:12])
cuda = device.startswith("cuda")
if not cuda:  # fail with MemoryError, never OOM the box
    resource.setrlimit(resource.RLIMIT_AS, (limit_gb << 30, limit_gb << 30))
    torch.set_num_threads(2)
torch.manual_seed(0)
s_head = torch.nn.Linear(H, V, bias=False, device=device, dtype=dtype).requires_grad_(heads == "trained")
t_head = torch.nn.Linear(H, V, bias=False, device=device, dtype=dtype).requires_grad_(False)
s_hidden = torch.randn(B, T, H, device=device, dtype=dtype, requires_grad=True)
t_hidden = torch.randn(B, T, H, device=device, dtype=dtype)
mask = torch.ones(B, T, device=device)
targets = torch.zeros(B, T, dtype=torch.long, device=device)

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))

def stage():
    if variant == "naive":
        ls = torch.log_softmax(s_head(s_hidden).float(), -1)        # [B, T, V] float32
        lt = torch.log_softmax(t_head(t_hidden).float(), -1)        # [B, T, V] float32
        kl = (ls.exp() * (ls - lt)).sum(-1)
    else:
        s = TokenStats(s_hidden, s_head, targets, mask, chunk=chunk)
        t = TokenStats(t_hidden, t_head, targets, mask, chunk=chunk)
        kl = token_divergence(s, t, "full")
    loss = kl.mean()
    loss.backward()
    return loss

if cuda:  # one warm-up (kernels, allocator), then `repeats` timed passes in this process
    stage(); s_hidden.grad = None; s_head.weight.grad = None
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        s_hidden.grad = None; s_head.weight.grad = None
        start = time.perf_counter()
        loss = stage()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
else:  # warm up imports and kernels on a tiny problem so that only the stage itself is measured
    _h, _t = torch.nn.Linear(H, 8, bias=False), torch.nn.Linear(H, 8, bias=False)
    _x = torch.randn(1, 4, H, requires_grad=True)
    token_divergence(TokenStats(_x, _h, targets[:1, :4], mask[:1, :4], chunk=2),
                     TokenStats(_x.detach(), _t, targets[:1, :4], mask[:1, :4], chunk=2), "full").sum().backward()
    base = rss_kb()
    start = time.perf_counter()
    loss = stage()
    seconds = time.perf_counter() - start
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps({"seconds": seconds, "peak_mb": peak_mb, "loss": loss.item()}))
"""


def run(variant: str, device: str, dtype: str, heads: str, B: int, T: int, H: int, V: int, chunk: int, limit_gb: int,
        inner: int = 1) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, variant, device, dtype, heads,
                          *map(str, (B, T, H, V, chunk, limit_gb, inner))], capture_output=True, text=True)
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
    ap.add_argument("--device", default="cpu", help="'cpu' or 'cuda'")
    ap.add_argument("--heads", nargs="+", default=["frozen", "trained"],
                    help="the student's output head: 'frozen' (LoRA) or 'trained' (full fine-tune: weight gradient too)")
    ap.add_argument("--dtype", default="float32", help="dtype of hidden states and heads (logits are float32)")
    ap.add_argument("--limit-gb", type=int, default=20, help="address-space cap per run (a larger need fails cleanly)")
    args = ap.parse_args()
    B, T = map(int, args.tokens.split("x"))
    where = args.device
    if args.device.startswith("cuda"):
        import torch
        where = f"{args.device} ({torch.cuda.get_device_name()})"
    print(f"B x T = {B} x {T}, H = {args.hidden}, chunk = {args.chunk}, {args.repeats} repeats, "
          f"{args.dtype} inputs, float32 logits, {where}\n")
    print("| vocab | student head | variant | peak MB (median) | seconds (median) | peak vs naive | time vs naive |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for V, heads in ((V, h) for V in args.vocab for h in args.heads):
        results = {}
        for variant in ("naive", "chunked"):
            runs = []
            cuda = args.device.startswith("cuda")  # on a GPU the repeats run inside one process
            for _ in range(1 if cuda else args.repeats):
                runs.append(run(variant, args.device, args.dtype, heads, B, T, args.hidden, V, args.chunk, args.limit_gb,
                                args.repeats if cuda else 1))
            ok = [r for r in runs if "error" not in r]
            results[variant] = ({"peak_mb": statistics.median(r["peak_mb"] for r in ok),
                                 "seconds": statistics.median(r["seconds"] for r in ok), "loss": ok[0]["loss"]}
                                if ok else {"error": runs[0]["error"]})
        n, c = results["naive"], results["chunked"]
        for variant, r in results.items():
            if "error" in r:
                print(f"| {V} | {heads} | {variant} | failed: {r['error'][:60]} | | | |")
                continue
            ratio_m = f"{r['peak_mb'] / n['peak_mb']:.2f}" if "error" not in n else "-"
            ratio_t = f"{r['seconds'] / n['seconds']:.2f}" if "error" not in n else "-"
            print(f"| {V} | {heads} | {variant} | {r['peak_mb']:.0f} | {r['seconds']:.2f} | {ratio_m} | {ratio_t} |")
        if "error" not in n and "error" not in c:
            tol = 1e-4 if args.dtype == "float32" else 2e-2
            assert abs(n["loss"] - c["loss"]) < tol * max(1.0, abs(n["loss"])), f"variants disagree: {n['loss']} vs {c['loss']}"


if __name__ == "__main__":
    main()
