"""The heap trim after a build: only a build from a checkpoint larger than any before in the process trims."""

from __future__ import annotations

import ctypes

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
