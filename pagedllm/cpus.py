"""The CPUs this process may use: its affinity and its cgroup's CPU quota (a container's `--cpus`), which
os.cpu_count() does not see. Plain data for the config; model/threads.py keeps the thread count right as it runs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use, and why: `usable` = min(affinity, the cgroup quota rounded down, >= 1)."""

    usable: int
    affinity: int
    quota: float | None  # cores, from cpu.max (v2) or cpu.cfs_quota_us / cpu.cfs_period_us (v1); None: no quota

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota is None else f"a CPU quota of {self.quota:g} cores"
        return f"{self.usable} usable CPUs ({self.affinity} in this process's affinity, {quota})"


def cpu_budget() -> CpuBudget:
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    usable = len(affinity) if quota is None else max(1, min(len(affinity), math.floor(quota)))
    return CpuBudget(usable, len(affinity), quota)


def cgroup_cpu_quota(root: Path = CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores, or None. Containers mount their own cgroup at the root."""
    for folder in (root, *_own_cgroup_folders(root)):
        quota = _read_quota_v2(folder / "cpu.max") or _read_quota_v1(folder / "cpu")
        if quota is not None:
            return quota
    return None


def _own_cgroup_folders(root: Path) -> list[Path]:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    return [root / line.split(":", 2)[2].lstrip("/") for line in lines if line.startswith("0::/") and len(line) > 4]


def _read_quota_v2(path: Path) -> float | None:
    try:
        limit, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) / int(period)


def _read_quota_v1(folder: Path) -> float | None:
    try:
        limit = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if limit <= 0 or period <= 0 else limit / period
