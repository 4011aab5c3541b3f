"""What the resident memory between training steps is made of: live tensors, malloc's heap, or mappings.

A run's per-phase peaks (`memory/peak_rss_gib/<phase>`) show what a step costs, not why the memory left
between steps grows. This script runs `lopd train` in-process with a hook after each of the loop's phases
that prints, per phase boundary: the resident memory (RSS), the bytes of every torch tensor storage alive
(found through the garbage collector: parameters, optimizer state, anything a reference still holds),
and glibc's own account (`mallinfo2`: bytes in use in its heaps, bytes free but kept in them, bytes in
separate mappings, the number of arenas). RSS minus live tensors minus the interpreter is what the
allocator keeps; a growing live-tensor sum is a reference leak.

    .venv/bin/python benchmarks/heap_between_steps.py --config /tmp/lopd-peaks-opsd.yaml run.dir=/tmp/heap-opsd \
        rollout.tasks_per_step=4 rollout.batch_size=32 train.max_rollouts=128 eval.every_rollouts=0 eval.max_tasks=2
"""

from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager
import sys
import time


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_stats() -> dict[str, float]:
    """glibc's heap account in GiB: in use (uordblks), free but kept (fordblks), mapped (hblkhd)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_in_use": m.uordblks / 2**30, "heap_free_kept": m.fordblks / 2**30, "mapped": m.hblkhd / 2**30,
            "arena_bytes": m.arena / 2**30}


def live_tensor_gib() -> float:
    """Bytes of every distinct tensor storage reachable by the garbage collector (CPU), in GiB."""
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                s = obj.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        except Exception:  # noqa: BLE001 (half-built objects, fake tensors)
            continue
    return sum(seen.values()) / 2**30


def largest_groups(n: int = 8) -> list[str]:
    """The live CPU tensors grouped by (shape, dtype), largest total first, with who refers to one of them."""
    import torch
    from collections import defaultdict

    groups: dict[tuple, list] = defaultdict(list)
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not isinstance(obj, torch.nn.Parameter):
                groups[(tuple(obj.shape), str(obj.dtype))].append(obj)
        except Exception:  # noqa: BLE001
            continue
    rows = sorted(groups.items(), key=lambda kv: -sum(t.untyped_storage().nbytes() for t in kv[1]))[:n]
    out = []
    for (shape, dtype), ts in rows:
        total = sum(t.untyped_storage().nbytes() for t in ts) / 2**20
        refs = [type(r).__name__ for r in gc.get_referrers(ts[0]) if r is not ts and r is not groups]
        out.append(f"{len(ts):5d} x {shape} {dtype}: {total:8.1f} MiB (storages, with sharing); held by {refs[:4]}")
    return out


def main(argv: list[str]) -> None:
    from lopd import host_memory, run_io
    from lopd.cli import main as cli_main

    original = run_io.Timer.__call__
    def report(phase: str) -> None:
        gc.collect()
        rss = (host_memory.rss_kib() or 0) / 2**20
        stats = malloc_stats()
        print(f"[heap] t={time.monotonic():.0f} after {phase:10s} rss {rss:6.2f}  live tensors {live_tensor_gib():6.2f}  "
              + "  ".join(f"{k} {v:6.2f}" for k, v in stats.items()), flush=True)
        if phase == "remember":
            for line in largest_groups():
                print("[heap]    ", line, flush=True)

    @contextmanager
    def timed(self, phase: str):
        with original(self, phase):
            yield
        if phase in ("rollout", "update", "remember"):
            report(phase)

    run_io.Timer.__call__ = timed
    sys.exit(cli_main(["train", *argv]))


if __name__ == "__main__":
    main(sys.argv[1:])
