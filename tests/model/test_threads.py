"""The model's thread count: the CPUs the process may use (affinity, cgroup quota) less the cores other processes
hold, re-read once a period; driven here by fake CPU samples and a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.cpus import CpuBudget, cgroup_cpu_quota, cpu_budget
from pagedllm.model.threads import CpuSample, ThreadGovernor


class FakeCpu:
    """Two CPUs: each `advance(others)` is one second in which this process used `ours` cores and others `others`."""

    def __init__(self) -> None:
        self.t = self.busy = self.ours = 0.0

    def advance(self, others: float, ours: float = 2.0) -> None:
        self.t += 1.0
        self.busy += min(2.0, others + ours)
        self.ours += ours

    def sample(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.ours)


def governor(cpu: FakeCpu, usable: int = 2) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    return ThreadGovernor(CpuBudget(usable, usable, None), calls.append, read=cpu.sample, period=1.0,
                          clock=lambda: cpu.t), calls


def test_starts_with_every_usable_cpu() -> None:
    gov, calls = governor(FakeCpu())
    assert gov.threads == 2 and calls == [2]


def test_a_core_taken_by_another_process_costs_one_thread_and_comes_back() -> None:
    cpu = FakeCpu()
    gov, calls = governor(cpu)
    cpu.advance(others=1.0, ours=1.0)
    gov.tick()
    assert gov.threads == 1
    cpu.advance(others=1.0, ours=1.0)
    gov.tick()
    assert calls == [2, 1]
    cpu.advance(others=0.0, ours=1.0)
    gov.tick()
    assert gov.threads == 2 and calls == [2, 1, 2]


@pytest.mark.parametrize(("others", "threads"), [(0.0, 4), (0.2, 4), (0.3, 3), (1.2, 3), (1.3, 2), (2.5, 1), (3.9, 1)])
def test_one_thread_fewer_per_core_others_hold(others: float, threads: int) -> None:
    gov, _ = governor(FakeCpu(), usable=4)
    assert gov.threads_for(others) == threads


def test_nothing_is_read_before_a_period_passes() -> None:
    cpu = FakeCpu()
    reads: list[float] = []
    gov = ThreadGovernor(CpuBudget(2, 2, None), lambda n: None, read=lambda: reads.append(cpu.t) or cpu.sample(),
                         period=1.0, clock=lambda: cpu.t)
    for _ in range(100):
        gov.tick()
    assert reads == [0.0]


def test_quota_from_cgroup_v2_and_v1(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_the_budget_of_this_process_is_at_least_one_cpu_and_says_why() -> None:
    budget = cpu_budget()
    assert 1 <= budget.usable <= budget.affinity
    assert f"{budget.usable} usable CPUs" in budget.describe()


def test_the_count_is_set_again_on_the_thread_that_steps() -> None:
    """OpenMP keeps a thread count per calling thread: a server builds its engine on one thread and steps on another."""
    import threading

    cpu = FakeCpu()
    gov, calls = governor(cpu)
    worker = threading.Thread(target=gov.tick)
    worker.start()
    worker.join()
    gov.tick()
    assert calls == [2, 2, 2]
