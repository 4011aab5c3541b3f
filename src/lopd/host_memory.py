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
the threshold is pinned only for the update; afterwards it is set to glibc's own ceiling (32 MiB, rollouts
within 6% of the default: 108 and 107 s against 100 and 102 s for 64 x 96 tokens) and the heap is trimmed.

Off glibc (macOS, musl, Windows) or on a GPU, where activations are not host memory, this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

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
    """Inside: every buffer of 1 MiB or more is mapped on its own and unmapped when freed, so resident
    memory follows the tensors alive rather than the heap's high-water mark. After: the decode-friendly
    threshold again, and the heap trimmed."""
    if not enabled or not set_mmap_threshold(UPDATE_MMAP_THRESHOLD):
        yield
        return
    try:
        yield
    finally:
        set_mmap_threshold(DECODE_MMAP_THRESHOLD)
        trim()
