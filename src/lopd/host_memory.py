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

It also measures resident memory, without ever resetting the kernel's high-water mark of the process's RSS
(VmHWM), which `/usr/bin/time -v`, cgroup accounting and cluster schedulers read: it is the process's
peak (`peak_rss_gib`). The peak of a phase (`PhasePeaks`) is exact when the phase set a new process peak
(VmHWM rose during it), and otherwise the largest RSS a background thread read every SAMPLE_S seconds
while the phase ran (one read of /proc/self/statm, a few microseconds). Resetting VmHWM at every phase, as
this module used to, made an outside measurement see only the last phase's peak (`time -v` 0.84 GB
against 1.60 GB sampled, on a 64-rollout LOPD run).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
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


SAMPLE_S = 0.02  # seconds between two reads of the resident memory while a phase is measured


def _high_water_kib() -> int | None:
    """VmHWM of /proc/self/status: the process's peak RSS since it started (KiB; None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024 if hasattr(os, "sysconf") else 4


def rss_kib() -> int | None:
    """The resident memory now (KiB; None off Linux): the second field of /proc/self/statm, in pages."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_KIB
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_gib() -> float:
    """This process's peak resident memory so far: the kernel's own mark, as `time -v` reports it."""
    mark = _high_water_kib()
    if mark is None:  # not Linux: the kernel's own account (KiB on Linux, bytes on macOS)
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**30 if sys.platform == "darwin" else peak / 2**20
    return mark / 2**20


class PhasePeaks:
    """The peak resident memory of named phases, which may overlap; the kernel's mark is never reset.

        peaks = PhasePeaks()
        peaks.start("update"); ...; gib = peaks.stop("update")

    `stop` returns the phase's peak in GiB: VmHWM at the end if the phase raised it (exact), else the largest
    RSS read at its start, its end and every SAMPLE_S seconds in between by a daemon thread that runs only
    while a phase is open. None where the resident memory cannot be read (not Linux)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, int]] = {}  # phase -> (VmHWM at its start, largest RSS read)
        self._thread: threading.Thread | None = None

    def start(self, phase: str) -> bool:
        """Start measuring `phase` (False where RSS cannot be read: then `stop` returns None)."""
        rss, mark = rss_kib(), _high_water_kib()
        if rss is None or mark is None:
            return False
        with self._lock:
            self._open[phase] = (mark, rss)
            if self._thread is None:
                self._thread = threading.Thread(target=self._sample, name="lopd-rss-sampler", daemon=True)
                self._thread.start()
        return True

    def stop(self, phase: str) -> float | None:
        rss, mark = rss_kib(), _high_water_kib()
        with self._lock:
            if phase not in self._open or rss is None or mark is None:
                return None
            start_mark, seen = self._open.pop(phase)
        return (mark if mark > start_mark else max(seen, rss)) / 2**20

    def _sample(self) -> None:
        while True:
            time.sleep(SAMPLE_S)
            rss = rss_kib() or 0
            with self._lock:
                if not self._open:  # nothing to measure: the thread ends, the next start makes another
                    self._thread = None
                    return
                self._open = {p: (mark, max(seen, rss)) for p, (mark, seen) in self._open.items()}


_PHASES = PhasePeaks()  # what the two functions below measure with


def start_phase_peak() -> bool:
    """Start measuring the peak RSS of a phase, read by `phase_peak_gib` (one at a time: a new start ends the
    previous one). False where there is no per-phase figure (not Linux). Nothing is reset."""
    _PHASES.stop("phase")
    return _PHASES.start("phase")


def phase_peak_gib() -> float | None:
    """Peak RSS (GiB) since the last `start_phase_peak`, which it ends."""
    return _PHASES.stop("phase")
