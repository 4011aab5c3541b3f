"""Freed activation memory goes back to the OS during the update (glibc), and nothing breaks elsewhere."""

import subprocess
import sys
import textwrap

import pytest

from lopd import host_memory

# Fragment the heap the way a backward does: large buffers of one size freed while smaller tensors made
# between them stay alive. Prints the resident MiB still held once the large ones are gone. Every mode
# starts where a run is between updates (the threshold at glibc's ceiling), not at glibc's start-up
# threshold: whether that one has risen past 4 MiB yet depends on what importing torch left in the heap,
# and a 4 MiB buffer mapped on its own would go back to the OS at its free whatever this module does.
# The tensors kept between the large ones are 256 KiB: small ones could come from holes the imports left
# (then the large ones would lie together at the heap's top, which glibc trims on its own).
FRAGMENT = textwrap.dedent("""
    import os, sys, torch
    from lopd import host_memory

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def churn():
        big, small = [], []
        for _ in range(100):
            big.append(torch.ones(1 << 20))  # 4 MiB each, 400 MiB in all
            small.append(torch.ones(1 << 16))
        before = rss_mib()
        big.clear()
        return before - rss_mib(), small

    assert host_memory.set_mmap_threshold(host_memory.DECODE_MMAP_THRESHOLD)
    if sys.argv[1] == "returned":
        with host_memory.activations_returned():
            freed, keep = churn()
    elif sys.argv[1] == "entered":  # the heap fragmented before the phase: given back on entry
        freed, keep = churn()
        before = rss_mib()
        with host_memory.activations_returned():
            freed = before - rss_mib()
    else:
        freed, keep = churn()
    print(round(freed))
""")


def freed_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(host_memory.glibc() is None, reason="the allocator is not glibc")
def test_freed_buffers_leave_the_process_only_when_returned():
    assert freed_mib("returned") > 350  # the 400 MiB went back to the OS at their free
    assert freed_mib("default") < 50  # the heap kept them: the failure this module exists for
    assert freed_mib("entered") > 350  # a heap fragmented before the update is trimmed when it starts


@pytest.mark.skipif(host_memory.glibc() is None, reason="the allocator is not glibc")
def test_glibc_takes_the_setting():
    assert host_memory.set_mmap_threshold(host_memory.DECODE_MMAP_THRESHOLD)


def test_harmless_without_glibc(monkeypatch):
    monkeypatch.setattr(host_memory, "glibc", lambda: None)
    assert not host_memory.set_mmap_threshold(1 << 20)
    host_memory.trim()
    with host_memory.activations_returned():
        pass
    with host_memory.activations_returned(enabled=False):
        pass


PHASES = textwrap.dedent("""
    import torch
    from lopd import host_memory

    assert host_memory.start_phase_peak()
    big = torch.ones(200 << 18)  # 200 MiB, touched
    del big
    first = host_memory.phase_peak_gib()
    assert host_memory.start_phase_peak()
    small = torch.ones(20 << 18)  # 20 MiB
    second = host_memory.phase_peak_gib()
    print(first, second, host_memory.peak_rss_gib())
""")


@pytest.mark.skipif(not host_memory.start_phase_peak(), reason="no resettable RSS high-water mark (not Linux)")
def test_each_phase_reads_its_own_peak_and_the_process_keeps_its_own():
    out = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True, check=True)
    first, second, process = map(float, out.stdout.split())
    assert first - second > 0.15  # the 200 MiB phase peaked higher than the 20 MiB one ...
    assert process >= first > 0.2  # ... and the process's peak survived the reset
