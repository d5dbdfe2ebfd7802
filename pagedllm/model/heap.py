"""Give the C heap's freed pages back to the system after a model's build.

glibc keeps much of what a process frees in its heap for later allocations, so the loader's plain weights and the
forms the measured dispatch dropped stayed in the engine's RSS after its start (a model of Llama-3.2-1B's shapes from
a Q4_1 GGUF: 5.5 GB after its first request, 4.4 GB once trimmed, AMD EPYC Zen 3; docs/performance.md,
memory at load). Only a build larger than any before in the process trims: after a smaller one, the heap's free pages
are what the next build takes again, and trimming after each of the test suite's hundreds of builds made every later
allocation fault its pages in again (the suite 7% slower, Zen 3).

During a build, large temporaries come from the heap too (`build_in_heap`): glibc maps each allocation above its mmap
threshold (at most 32 MiB) afresh and unmaps it when freed, so every dequantized matrix and packed copy faulted its
pages in again, at ~0.4 s per GiB on this project's VMs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator

_largest_build = 0  # bytes of the largest checkpoint this process has built a model from
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
BUILD_MMAP_THRESHOLD = 1 << 30  # during a build: allocations up to 1 GiB from the heap, nor its top trimmed
# after it: glibc's own ceilings, which its adaptive threshold reaches once a 32 MiB block has been freed
STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD = 32 << 20, 64 << 20
_builds = 0  # builds under way (engines may be built on several threads)
_builds_lock = threading.Lock()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; other C libraries (musl, macOS) have none
    except (OSError, AttributeError):
        return None


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    try:
        return ctypes.CDLL(None).mallopt  # glibc's (musl has none; macOS none)
    except (OSError, AttributeError):
        return None


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> None:
    """mallopt takes a C int: both values below 2 GiB."""
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, mmap_threshold)  # 0 (ignored) where a glibc refuses the value
        mallopt(M_TRIM_THRESHOLD, trim_threshold)


@contextlib.contextmanager
def build_in_heap() -> Iterator[None]:
    """Serve the allocations of a model's build from the heap, where freed blocks are reused without faulting their
    pages in again; glibc's steady-state thresholds once the last build under way ends (the KV pool, allocated
    after, is mapped as before). The default model's load and build pieces: 0.77 s instead of 1.21, AMD EPYC Zen 3
    (docs/results/side_by_side/2026-11-30/startup_build/probes/build_pieces.py)."""
    global _builds
    with _builds_lock:
        _builds += 1
        _set_thresholds(BUILD_MMAP_THRESHOLD, BUILD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _builds_lock:
            _builds -= 1
            if not _builds:
                _set_thresholds(STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD)


def trim() -> bool:
    """Return the heap's free pages to the system (malloc_trim); False where the C library has no such call."""
    malloc_trim = _malloc_trim()
    return bool(malloc_trim(0)) if malloc_trim is not None else False


def trim_after_build(checkpoint_bytes: int) -> bool:
    """Trim after a build from a checkpoint larger than any this process built from before; else leave the heap."""
    global _largest_build
    if checkpoint_bytes <= _largest_build:
        return False
    _largest_build = checkpoint_bytes
    return trim()
