"""Give the C heap's freed pages back to the system after a model's build.

glibc keeps much of what a process frees in its heap for later allocations, so the loader's plain weights and the
forms the measured dispatch dropped stayed in the engine's RSS after its start (a model of Llama-3.2-1B's shapes from
a Q4_1 GGUF: 5.5 GB after its first request, 4.4 GB once trimmed, AMD EPYC Zen 3; docs/performance.md,
memory at load).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


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
