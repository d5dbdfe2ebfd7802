"""Map the KV pool's memory in the background, so that a step never stops to fault a fresh page in.

The pool is allocated uninitialised (zeroing GiBs up front would hold start-up for seconds), so each page faults in the
first time a block on it is written. On this project's VMs a first touch costs the host's page allocation too,
~2 s per GiB: a 200-request benchmark spent 2-3 s of its minute in the KV write alone. A low-priority thread asks the
kernel to map the pool (madvise MADV_POPULATE_WRITE, Linux 5.14+; contents untouched) in block order, the order the
pool hands blocks out, so it runs ahead of use and yields the cores to the model when both want them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Sequence

import torch

logger = logging.getLogger("pagedllm")

MADV_POPULATE_WRITE = 23  # linux/mman.h
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CHUNK_BLOCKS = 256  # blocks mapped per call and tensor: small enough that the pool's first blocks are ready at once


class KVPrefault:
    """A daemon thread mapping `caches` (tensors of [num_blocks, ...]) chunk by chunk; `wait()` joins it. It stops on
    its own when the caches are freed (an engine replaced) or when the kernel cannot populate."""

    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        self.done = threading.Event()
        self.error: str | None = None
        alive = weakref.ref(caches[0]) if caches else None
        spans = [(t.data_ptr(), t[0].numel() * t.element_size(), t.shape[0]) for t in caches]
        self._thread = threading.Thread(target=self._run, args=(spans, alive), name="pagedllm-kv-prefault",
                                        daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every page is mapped (or the kernel cannot do it, `error` says why)."""
        return self.done.wait(timeout)

    def _run(self, spans: list[tuple[int, int, int]], alive: weakref.ref | None) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
            madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes drops the GIL for the call
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            num_blocks = max((n for _, _, n in spans), default=0)
            for first in range(0, num_blocks, CHUNK_BLOCKS):
                for ptr, block_bytes, n in spans:
                    if alive is None or alive() is None:
                        return
                    if first >= n:
                        continue
                    start = ptr + first * block_bytes
                    end = ptr + min(n, first + CHUNK_BLOCKS) * block_bytes
                    aligned = start - start % PAGE
                    if madvise(aligned, end - aligned, MADV_POPULATE_WRITE) != 0:
                        self.error = os.strerror(ctypes.get_errno())
                        logger.debug("KV pool prefault stopped: %s", self.error)
                        return
        except (OSError, AttributeError) as e:  # no libc madvise, or no per-thread priority
            self.error = str(e)
        finally:
            self.done.set()
