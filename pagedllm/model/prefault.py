"""Map the KV pool's memory in the background, ahead of use, so that a step never stops to fault a fresh page in.

The pool is allocated uninitialised (zeroing GiBs up front would hold start-up for seconds), so each page faults in the
first time a block on it is written. On this project's VMs a first touch costs the host's page allocation too,
~2 s per GiB: a 200-request benchmark spent 2-3 s of its minute in the KV write alone. A low-priority thread asks the
kernel to map the pool (madvise MADV_POPULATE_WRITE, Linux 5.14+; contents untouched) in block order, the order the
pool hands blocks out, and only `AHEAD_BLOCKS` past the highest block a step has used: mapping all of a 4 GiB pool
while a server already serves took CPU from the model's threads (a benchmark right after start-up ran ~9% slower,
docs/performance.md) for pages most runs never touch.
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
AHEAD_BLOCKS = 1024  # mapped past the highest block in use: 8 full 2,048-token prefill steps' worth of new blocks


class KVPrefault:
    """A daemon thread mapping `caches` (tensors of [num_blocks, ...]) chunk by chunk up to a target that steps raise
    (`run_ahead_of`) and `wait()` sets to the whole pool. It stops on its own when the caches are freed (an engine
    replaced) or when the kernel cannot populate."""

    def __init__(self, caches: Sequence[torch.Tensor], ahead: int = AHEAD_BLOCKS) -> None:
        self.done = threading.Event()
        self.error: str | None = None
        self.ahead = ahead
        self.num_blocks = max((t.shape[0] for t in caches), default=0)
        self.target = min(ahead, self.num_blocks)  # blocks [0, target) are wanted mapped
        self._wanted = threading.Condition()
        alive = weakref.ref(caches[0]) if caches else None
        spans = [(t.data_ptr(), t[0].numel() * t.element_size(), t.shape[0]) for t in caches]
        self._thread = threading.Thread(target=self._run, args=(spans, alive), name="pagedllm-kv-prefault",
                                        daemon=True)
        self._thread.start()

    def run_ahead_of(self, block_id: int) -> None:
        """A step uses blocks up to `block_id`: keep `ahead` blocks past it mapped (a compare when nothing changes)."""
        target = min(block_id + 1 + self.ahead, self.num_blocks)
        if target > self.target:
            self._raise_target(target)

    def wait(self, timeout: float | None = None) -> bool:
        """Map the whole pool now; True once every page is mapped (or the kernel cannot do it, `error` says why)."""
        self._raise_target(self.num_blocks)
        return self.done.wait(timeout)

    def _raise_target(self, target: int) -> None:
        with self._wanted:
            self.target = max(self.target, target)
            self._wanted.notify()

    def _next_target(self, mapped: int, alive: weakref.ref | None) -> int:
        """Block until more than `mapped` blocks are wanted; `mapped` itself once the caches are gone."""
        with self._wanted:
            while self.target <= mapped:
                if alive is None or alive() is None:
                    return mapped
                self._wanted.wait(timeout=1.0)
            return self.target

    def _run(self, spans: list[tuple[int, int, int]], alive: weakref.ref | None) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
            madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes drops the GIL for the call
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            mapped = 0
            while mapped < self.num_blocks:
                target = self._next_target(mapped, alive)
                if target == mapped:
                    return
                for first in range(mapped, target, CHUNK_BLOCKS):
                    for ptr, block_bytes, n in spans:
                        if alive is None or alive() is None:
                            return
                        if first >= n:
                            continue
                        start = ptr + first * block_bytes
                        end = ptr + min(n, first + CHUNK_BLOCKS, target) * block_bytes
                        aligned = start - start % PAGE
                        if madvise(aligned, end - aligned, MADV_POPULATE_WRITE) != 0:
                            self.error = os.strerror(ctypes.get_errno())
                            logger.debug("KV pool prefault stopped: %s", self.error)
                            return
                mapped = target
        except (OSError, AttributeError) as e:  # no libc madvise, or no per-thread priority
            self.error = str(e)
        finally:
            self.done.set()
