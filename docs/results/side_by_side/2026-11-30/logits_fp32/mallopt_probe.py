"""Page faults of the int8 lm_head's call (Int8Weight.mm, a fresh output each call) at 200 and 256 rows, on the main
thread or a second one, with glibc's defaults or with mallopt raising the mmap and trim thresholds to 1 GiB (and, in
`thread_opt_arena`, one arena for all threads). ms (best of 10) and minor faults per call, 2 threads.

    python mallopt_probe.py main|main_opt|thread|thread_opt|thread_opt_arena
"""

from __future__ import annotations

import ctypes
import resource
import sys
import threading
import time

import torch

from pagedllm.entrypoints.llm import LLM

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8


def run(head, mode: str) -> None:
    for rows in (200, 256):
        x = torch.randn(rows, 576) * 2
        head.mm(x)
        faults, best = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, float("inf")
        for _ in range(10):
            start = time.perf_counter()
            head.mm(x)
            best = min(best, time.perf_counter() - start)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 10
        print(mode, rows, f"{best * 1e3:.2f} ms", faults, "faults/call")


def main() -> None:
    mode, libc = sys.argv[1], ctypes.CDLL(None)
    if "arena" in mode:
        print("arena_max", libc.mallopt(M_ARENA_MAX, 1))
    head = LLM(None, threads=2).engine.runner.model.lm_head_weight.int8
    if "opt" in mode:
        print("mallopt mmap", libc.mallopt(M_MMAP_THRESHOLD, 1 << 30), "trim", libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    if "thread" in mode:
        worker = threading.Thread(target=run, args=(head, mode))
        worker.start()
        worker.join()
    else:
        run(head, mode)


if __name__ == "__main__":
    main()
