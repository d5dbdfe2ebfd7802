"""The heap after a build: only a build from a checkpoint larger than any before in the process trims; during builds,
large allocations come from the heap."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import pytest

from pagedllm.model import heap


def test_only_a_build_larger_than_any_before_trims(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "_largest_build", 0)
    monkeypatch.setattr(heap, "_malloc_trim", lambda: lambda pad: calls.append(pad) or 1)
    trimmed = [heap.trim_after_build(n) for n in (100, 50, 100, 200, 150)]
    assert trimmed == [True, False, False, True, False]
    assert calls == [0, 0]


def test_trim_returns_freed_heap_pages_where_the_c_library_can() -> None:
    if heap._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(256)]  # 16 MiB in blocks below glibc's mmap threshold: the heap
    fence = libc.malloc(64)  # after them: freed, they cannot join the heap's top, which free() may give back itself
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)  # touched: resident
    for block in blocks:
        libc.free(block)
    try:
        assert heap.trim()  # glibc: 1 when it returned memory to the system
    finally:
        libc.free(fence)


def test_builds_raise_the_mmap_threshold_until_the_last_one_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    monkeypatch.setattr(heap, "_builds", 0)
    raised = [(heap.M_MMAP_THRESHOLD, heap.BUILD_MMAP_THRESHOLD), (heap.M_TRIM_THRESHOLD, heap.BUILD_MMAP_THRESHOLD)]
    steady = [(heap.M_MMAP_THRESHOLD, heap.STEADY_MMAP_THRESHOLD), (heap.M_TRIM_THRESHOLD, heap.STEADY_TRIM_THRESHOLD)]
    inside, leave = threading.Event(), threading.Event()

    def other_build() -> None:
        with heap.build_in_heap():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other_build)
    thread.start()
    inside.wait(10)
    with pytest.raises(ValueError), heap.build_in_heap():
        raise ValueError("a bad checkpoint")
    assert calls == raised + raised  # the other build is still under way: nothing restored
    leave.set()
    thread.join(10)
    assert calls == raised + raised + steady


PROBE = """
import ctypes
from pagedllm.model import heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
size = 64 << 20  # above glibc's largest own mmap threshold (32 MiB): mapped afresh at each allocation


def in_heap():
    block = libc.malloc(size)
    below_break = block + size <= libc.sbrk(0)  # the main heap ends at the program break; mappings lie far above
    libc.free(block)
    return below_break


before = in_heap()
with heap.build_in_heap():
    during = in_heap()
print(before, during)
"""


def test_a_build_takes_large_blocks_from_the_heap_where_glibc_allows() -> None:
    libc = ctypes.CDLL(None)
    if heap._mallopt() is None or not hasattr(libc, "sbrk"):
        pytest.skip("not glibc")
    # a fresh process: this one's heap may hold a free block that size from earlier tests
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.split() == ["False", "True"]
