"""How many threads the model's matmuls and kernels use: the CPUs this process may run on (its affinity and a
cgroup's CPU quota), less the cores other processes are taking, re-read while the engine runs.

OpenMP splits every matmul evenly across its threads and waits at a barrier for the last one: when another process
holds one of two cores, the thread that shares it arrives a scheduler slice late at every barrier, and a step can
take several times as long as on one thread (docs/performance.md, "When other processes share the CPU"). So the
governor counts the CPU time others used on our CPUs over the last second (/proc/stat minus our own) and runs one
thread fewer per core they hold.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedllm.cpus import CpuBudget, cpu_budget

logger = logging.getLogger("pagedllm.model.threads")
PERIOD_S = 1.0  # how often the governor looks at the CPUs
# A core counts as taken when others used at least this much of one over the last period. Single stream on the
# 2-vCPU Xeon with half a core busy elsewhere: 2 threads 25.4 tokens/s, 1 thread 40.1 (docs/scripts/thread_governor.sh).
TAKEN_CORE = 0.25


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds at one moment: busy time of our CPUs (all processes) and of this process, and the wall clock."""

    wall: float
    busy: float
    ours: float


def read_cpu_sample(cpus: frozenset[int] | None = None) -> CpuSample | None:
    """From /proc/stat (clock ticks) and os.times(); None where there is no /proc."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in values[:8])
        busy += user + nice + system + irq + softirq + steal
    t = os.times()
    return CpuSample(time.monotonic(), busy / ticks, t.user + t.system)


def others_cpu(start: CpuSample, end: CpuSample) -> float:
    """The CPUs' worth of time other processes used on ours between two samples (end after start)."""
    return max(0.0, (end.busy - start.busy) - (end.ours - start.ours)) / (end.wall - start.wall)


def affinity() -> frozenset[int] | None:
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


class ThreadGovernor:
    """Sets the model's thread count to the usable CPUs less the cores others hold, once a `period`; logs changes.
    Fixed (`--threads N`) engines have none."""

    def __init__(self, budget: CpuBudget, set_threads: Callable[[int], None],
                 read: Callable[[], CpuSample | None] | None = None, period: float = PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        cpus = affinity()
        self.budget, self.set_threads, self.period, self.clock = budget, set_threads, period, clock
        self.read = read or (lambda: read_cpu_sample(cpus))
        self.threads = budget.usable
        self.last = self.read()
        self.next_check = clock() + period
        self.thread_id = threading.get_ident()
        set_threads(self.threads)

    def tick(self) -> None:
        """Between steps: cheap unless a period has passed. OpenMP's thread count belongs to the calling thread, so
        the first tick on a new thread (a server steps on its own) sets it there too."""
        if threading.get_ident() != self.thread_id:
            self.thread_id = threading.get_ident()
            self.set_threads(self.threads)
        if self.clock() < self.next_check:
            return
        self.next_check = self.clock() + self.period
        sample = self.read()
        if sample is None or self.last is None or sample.wall <= self.last.wall:
            self.last = sample
            return
        others = others_cpu(self.last, sample)
        self.last = sample
        self.apply(self.threads_for(others), others)

    def threads_for(self, others: float) -> int:
        """One thread fewer per core others hold (TAKEN_CORE of it or more), never fewer than one."""
        return max(1, self.budget.usable - math.floor(others + 1 - TAKEN_CORE))

    def apply(self, threads: int, others: float) -> None:
        if threads != self.threads:
            logger.info("threads %d -> %d: other processes used %.1f of the %d usable CPUs over the last %g s",
                        self.threads, threads, others, self.budget.usable, self.period)
            self.threads = threads
            self.set_threads(threads)


def start_threads(threads: int | None) -> ThreadGovernor | None:
    """Set torch's threads for this process: `threads` as given (a warning if more than the CPUs it may use), or,
    by default, a governor starting with every usable CPU. Logs the choice."""
    import torch

    budget = cpu_budget()
    if threads is not None:
        if threads > budget.usable:
            logger.warning("--threads %d is more than the %s: threads will wait for each other's cores",
                           threads, budget.describe())
        torch.set_num_threads(threads)
        return None
    logger.info("threads: %d, one fewer per core other processes hold (%s; --threads N fixes the count)",
                budget.usable, budget.describe())
    return ThreadGovernor(budget, torch.set_num_threads)
