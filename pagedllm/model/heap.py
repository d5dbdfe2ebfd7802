"""Give the C heap's freed pages back to the system after a model's build.

glibc keeps much of what a process frees in its heap for later allocations, so the loader's plain weights and the
forms the measured dispatch dropped stayed in the engine's RSS after its start (a model of Llama-3.2-1B's shapes from
a Q4_1 GGUF: 5.5 GB after its first request, 4.4 GB once trimmed, AMD EPYC Zen 3; docs/performance.md,
memory at load). Only a build larger than any before in the process trims: after a smaller one, the heap's free pages
are what the next build takes again, and trimming after each of the test suite's hundreds of builds made every later
allocation fault its pages in again (the suite 7% slower, Zen 3).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

_largest_build = 0  # bytes of the largest checkpoint this process has built a model from


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; other C libraries (musl, macOS) have none
    except (OSError, AttributeError):
        return None


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
