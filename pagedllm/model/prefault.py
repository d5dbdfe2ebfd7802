"""Map the KV pool's memory ahead of use, so that a step never stops to fault a fresh page in.

The pool is allocated uninitialised (zeroing GiBs would hold `LLM()` for seconds), so each page faults in the first
time a block on it is written. On this project's VMs a first touch costs the host's page allocation too, ~2 s per
GiB: a 200-request benchmark spent 2-3 s of its minute in the KV write alone. A low-priority thread asks the kernel to
map the pool (madvise MADV_POPULATE_WRITE, Linux 5.14+; contents untouched) in block order, the order the pool hands
blocks out, `AHEAD_BLOCKS` past the highest block a step has used. `wait()` maps the rest at once: a benchmark does it
before its clock, a server before its first request (async_engine.build_serving_engine).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger("pagedllm")

MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # linux/mman.h
HUGE_PAGE = 2 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CHUNK_BLOCKS = 256  # blocks mapped per call and tensor: small enough that the pool's first blocks are ready at once
AHEAD_BLOCKS = 1024  # mapped past the highest block in use: 8 full 2,048-token prefill steps' worth of new blocks


class KVPrefault:
    """A daemon thread mapping `caches` (tensors of [num_blocks, ...]) chunk by chunk, from the bottom, up to a target
    that steps raise (`run_ahead_of`); `wait()` wants the whole pool and maps chunks from the top itself until the two
    meet (the caller would only sit idle; two threads map 4 GiB here in ~4.5 s instead of ~8). It stops on its own
    when the caches are freed (an engine replaced) or when the kernel cannot populate."""

    def __init__(self, caches: Sequence[torch.Tensor], ahead: int = AHEAD_BLOCKS) -> None:
        self.done = threading.Event()
        self.error: str | None = None
        self.ahead = ahead
        self.num_blocks = max((t.shape[0] for t in caches), default=0)
        self.target = min(ahead, self.num_blocks)  # blocks [0, target) are wanted mapped
        self._low, self._high = 0, self.num_blocks  # chunks below _low / from _high up are claimed
        self._num_mapped = 0
        self._wanted = threading.Condition()
        self._alive = weakref.ref(caches[0]) if caches else None
        self._spans = [(t.data_ptr(), t[0].numel() * t.element_size(), t.shape[0]) for t in caches]
        self.huge_pages = advise_huge_pages(caches)
        if not caches:
            self.done.set()
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-prefault", daemon=True)
        self._thread.start()

    def run_ahead_of(self, block_id: int) -> None:
        """A step uses blocks up to `block_id`: keep `ahead` blocks past it mapped (a compare when nothing changes)."""
        target = min(block_id + 1 + self.ahead, self.num_blocks)
        if target > self.target:
            self._raise_target(target)

    def wait(self, timeout: float | None = None) -> bool:
        """Map the whole pool now, this thread helping; True once every page is mapped (or the kernel cannot do it,
        `error` says why)."""
        self._raise_target(self.num_blocks)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done.is_set() and (deadline is None or time.monotonic() < deadline):
            chunk = self._claim_top()
            if chunk is None or not self._map(*chunk):
                break
        return self.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _raise_target(self, target: int) -> None:
        with self._wanted:
            self.target = max(self.target, target)
            self._wanted.notify()

    def _gone(self) -> bool:
        return self._alive is None or self._alive() is None

    def _claim_bottom(self) -> tuple[int, int] | None:
        """The background thread's next chunk, waiting until one is wanted; None once all are claimed or the caches
        are gone."""
        with self._wanted:
            while self._low >= min(self.target, self._high):
                if self._low >= self._high or self._gone():
                    return None
                self._wanted.wait(timeout=1.0)
            first = self._low
            self._low = min(first + CHUNK_BLOCKS, self.target, self._high)
            return first, self._low

    def _claim_top(self) -> tuple[int, int] | None:
        with self._wanted:
            if self._high <= self._low:
                return None
            last = self._high
            self._high = max(last - CHUNK_BLOCKS, self._low)
            return self._high, last

    def _map(self, first: int, last: int) -> bool:
        """Populate blocks [first, last) of every tensor; False (and `error` set, `done` too) if the kernel refuses."""
        for ptr, block_bytes, n in self._spans:
            if self._gone():
                return False
            if first >= n:
                continue
            start = ptr + first * block_bytes
            end = ptr + min(n, last) * block_bytes
            aligned = start - start % PAGE
            try:
                failed = _madvise()(aligned, end - aligned, MADV_POPULATE_WRITE) != 0
            except (OSError, AttributeError) as e:  # no libc madvise
                return self._stop(str(e))
            if failed:
                return self._stop(os.strerror(ctypes.get_errno()))
        with self._wanted:
            self._num_mapped += last - first
            if self._num_mapped >= self.num_blocks:
                self.done.set()
        return True

    def _stop(self, error: str) -> bool:
        self.error = error
        logger.debug("KV pool prefault stopped: %s", error)
        self.done.set()
        return False

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
        except (OSError, AttributeError) as e:  # no per-thread priority: mapping now would compete with the model
            self._stop(str(e))
            return
        while (chunk := self._claim_bottom()) is not None and self._map(*chunk):
            pass
        if self._gone():
            self.done.set()


def advise_huge_pages(caches: Sequence[torch.Tensor]) -> bool:
    """Ask for transparent huge pages on each tensor's 2 MiB-aligned span, before any page of it is touched: decode
    attention reads blocks scattered over the pool, and with 4 KiB pages a TLB miss stalls many of those reads (2 MiB
    pages: its read rate +7-9% alone, the whole workload +0.6%, on the Intel kind without BF16). False where the
    kernel refuses (THP off, not Linux): nothing changes then."""
    try:
        madvise = _madvise()
        for t in caches:
            start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
            end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
            if end > start and madvise(start, end - start, MADV_HUGEPAGE) != 0:
                logger.debug("KV pool: no huge pages: %s", os.strerror(ctypes.get_errno()))
                return False
    except (OSError, AttributeError) as e:  # no libc madvise
        logger.debug("KV pool: no huge pages: %s", e)
        return False
    return bool(caches)


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    """libc's madvise through ctypes, which drops the GIL for the call (AttributeError without one)."""
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn
