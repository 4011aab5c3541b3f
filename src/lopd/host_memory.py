"""Host (CPU) memory held by the allocator rather than by tensors.

On a CPU a forward+backward micro-batch frees hundreds of activation buffers of 1-30 MiB each. glibc's
malloc serves a freed buffer's size from its heap from then on (its mmap threshold rises to the largest
size freed, up to 32 MiB), and a fragmented heap is not given back to the OS: measured on SmolLM2-135M with
LoRA, two micro-batches of 7,241 tokens that keep 9.6 GiB of tensors peaked at 21.6 GiB of resident memory
and held 13.2 GiB between micro-batches, enough to get a 24 GiB machine's run killed
(benchmarks/RESULTS.md, section 13). Inside `activations_returned()` every large buffer is its own mapping
and goes back to the OS when freed: peak 13.0 GiB, 4.5 GiB between micro-batches, 3.0 GiB after the phase,
and no slower (65 and 75 s per micro-batch against 85). Decoding is the opposite case (a KV cache
re-allocated every token: with the threshold at 1 MiB for the whole process, rollouts took 42% longer), so
the threshold is pinned only for the update, whose start also trims the heap decoding left. Afterwards it
is set to glibc's own ceiling (32 MiB; rollouts within 6% of the default: 108 and 107 s against 100 and
102 s for 64 x 96 tokens) and the heap is trimmed again.

Off glibc (macOS, musl, Windows) or on a GPU, where activations are not host memory, this does nothing.

It also measures resident memory per phase: Linux keeps the high-water mark of a process's RSS (VmHWM) and
resets it on request (`/proc/self/clear_refs`), so the loop can say which phase of a step peaked, and the
process's own peak is kept across the resets.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
UPDATE_MMAP_THRESHOLD = 1 << 20  # bytes: larger allocations are mapped on their own while training
DECODE_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX)


@cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has mallopt and malloc_trim), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def set_mmap_threshold(nbytes: int) -> bool:
    """Allocations of at least `nbytes` get their own mapping (returned to the OS when freed). True when
    the allocator took the setting."""
    libc = glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, nbytes) == 1)


def trim() -> None:
    """Give the free pages of malloc's heaps back to the OS."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextmanager
def activations_returned(enabled: bool = True) -> Iterator[None]:
    """On entry the heap that decoding left behind is trimmed; inside, every buffer of 1 MiB or more is
    mapped on its own and unmapped when freed, so resident memory follows the tensors alive rather than
    the heap's high-water mark. After: the decode-friendly threshold again, and the heap trimmed."""
    if not enabled or not set_mmap_threshold(UPDATE_MMAP_THRESHOLD):
        yield
        return
    trim()
    try:
        yield
    finally:
        set_mmap_threshold(DECODE_MMAP_THRESHOLD)
        trim()


_process_peak_kib = 0  # the largest high-water mark read before a reset


def _high_water_kib() -> int | None:
    """VmHWM of /proc/self/status: the peak RSS since the process started or the mark was last reset."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, resets of the phase mark included."""
    global _process_peak_kib
    mark = _high_water_kib()
    if mark is None:  # not Linux: the kernel's own account (KiB on Linux, bytes on macOS)
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**30 if sys.platform == "darwin" else peak / 2**20
    _process_peak_kib = max(_process_peak_kib, mark)
    return _process_peak_kib / 2**20


def start_phase_peak() -> bool:
    """Reset the RSS high-water mark so `phase_peak_gib` reads the peak from now on; False where the kernel
    offers no reset (then there is no per-phase figure)."""
    peak_rss_gib()  # keep the process's peak before it is forgotten
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (proc(5))
    except OSError:
        return False
    return True


def phase_peak_gib() -> float | None:
    """Peak RSS since the last `start_phase_peak`."""
    mark = _high_water_kib()
    return None if mark is None else mark / 2**20
