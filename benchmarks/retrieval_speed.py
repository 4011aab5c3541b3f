"""Benchmark: experience-bank retrieval, add and reload at up to 100,000 entries.

Retrieval is one matrix product of unit keys (cosine similarity) plus a top-k, with the exclusion
rules applied (successes only, own group excluded). LOPD searches once per sampling group, so a step of
the demo makes 16 queries (16 tasks x 8 trajectories); 128 queries is the per-trajectory worst case.
k = 4, 384-dim keys (MiniLM). Medians over repeats, measured in one process.

    python benchmarks/retrieval_speed.py
    python benchmarks/retrieval_speed.py --sizes 1000 10000 100000 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from lopd.latent.experience_bank import Experience, ExperienceBank


def unit(rng, n, dim):
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"dim {args.dim}, k 4, medians of {args.repeats} repeats\n")
    print("| entries | search 16 queries (ms) | search 128 queries (ms) | add 128 (ms, fsync) | reload from disk (s) |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            bank = ExperienceBank(args.dim, tmp)
            chunk = 10_000
            for start in range(0, n, chunk):
                m = min(chunk, n - start)
                bank.add([Experience(f"t{start + i}", "task", "answer", float(i % 2), bool(i % 2), step=1,
                                     group=f"1:{(start + i) % 16}") for i in range(m)], unit(rng, m, args.dim))
            timings = {}
            for q in (16, 128):
                queries = unit(rng, q, args.dim)
                groups = [f"1:{i % 16}" for i in range(q)]
                runs = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    bank.search(queries, 4, exclude_groups=groups)
                    runs.append(time.perf_counter() - t)
                timings[q] = statistics.median(runs) * 1000
            adds = []
            for _ in range(5):
                exps = [Experience("x", "task", "answer", 1.0, True) for _ in range(128)]
                t = time.perf_counter()
                bank.add(exps, unit(rng, 128, args.dim))
                adds.append(time.perf_counter() - t)
            t = time.perf_counter()
            ExperienceBank(args.dim, tmp)
            reload = time.perf_counter() - t
        print(f"| {n} | {timings[16]:.1f} | {timings[128]:.1f} | {statistics.median(adds) * 1000:.1f} | {reload:.2f} |")


if __name__ == "__main__":
    main()
