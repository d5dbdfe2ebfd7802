"""The machine-limit estimate's speeds come from this machine: measured once per CPU model, ISA flags, threads and
torch (machine_cache.machine_key), cached beside the kernel table, and said where they came from. Fake
measurements, no timing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.bench import roofline
from pagedllm.model import machine_cache

pytestmark = pytest.mark.usefixtures("fake_machine")  # each test its own cache folder


class FakeMeasure:
    """Speeds that grow with each call, so a figure tells which measurement it came from."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, dtype_name: str) -> dict[str, float]:
        self.calls.append(dtype_name)
        return {f"{dtype_name}_gflops": 300.0 + len(self.calls), "copy_gbps": 30.0 + len(self.calls)}


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(machine_cache, "machine_load", lambda: 0.0)
    monkeypatch.setattr(machine_cache, "others_since", lambda start: 0.0)


def test_measured_once_then_read_from_the_cache(quiet):
    measure = FakeMeasure()
    first = roofline.local_machine("float32", measure=measure)
    assert (first.peak_gflops, first.mem_gbps) == (301.0, 31.0) and first.source.startswith("measured here, cached")
    again = roofline.local_machine("float32", measure=measure)
    assert (again.peak_gflops, again.mem_gbps) == (301.0, 31.0) and again.source.startswith("measured here earlier")
    assert measure.calls == ["float32"]
    fresh = roofline.local_machine("float32", refresh=True, measure=measure)  # --measure-machine
    assert fresh.peak_gflops == 302.0 and roofline.local_machine("float32", measure=measure).peak_gflops == 302.0


def test_keyed_by_dtype_and_machine(quiet, monkeypatch):
    measure = FakeMeasure()
    roofline.local_machine("float32", measure=measure)
    assert roofline.local_machine("bfloat16", measure=measure).peak_gflops == 302.0  # its own entry
    key = machine_cache.machine_key()
    for field, other in (("cpu", "another CPU"), ("isa", "0" * 16), ("threads", "7"), ("torch", "0.0")):
        monkeypatch.setattr(machine_cache, "machine_key", lambda field=field, other=other: {**key, field: other})
        assert roofline.local_machine("float32", measure=measure).source.startswith("measured here, cached"), field
    assert len(measure.calls) == 6
    monkeypatch.setattr(machine_cache, "machine_key", lambda: dict(key))
    assert roofline.local_machine("float32", measure=measure).peak_gflops == 301.0  # the first one, still there


def test_a_busy_measurement_is_used_but_not_cached(monkeypatch):
    monkeypatch.setattr(machine_cache, "machine_load", lambda: 0.0)
    monkeypatch.setattr(machine_cache, "others_since", lambda start: 0.6)
    measure = FakeMeasure()
    busy = roofline.local_machine("float32", measure=measure)
    assert busy.peak_gflops == 301.0 and "not cached" in busy.source
    assert roofline.local_machine("float32", measure=measure).peak_gflops == 302.0
    assert len(measure.calls) == 2


def test_a_foreign_or_broken_cache_file_is_measured_again(quiet):
    measure = FakeMeasure()
    file = machine_cache.cache_file(roofline.cache_key("float32"), roofline.MACHINE_CACHE)
    file.parent.mkdir(parents=True, exist_ok=True)
    for text in ("not json", '{"key": {"cpu": "other"}, "measured": {"float32_gflops": 1, "copy_gbps": 1}}'):
        file.write_text(text)
        assert roofline.local_machine("float32", measure=measure).source.startswith("measured here, cached")
    assert len(measure.calls) == 2


def test_the_estimate_says_where_its_speeds_come_from():
    machine = roofline.Machine(100.0, 10.0, source="assumed (--peak-gflops)")
    bound = roofline.workload_bound(_config(), torch.float32, [(10, 10)], machine)
    assert bound["source"] == "assumed (--peak-gflops)" and bound["peak_gflops"] == 100.0


def test_the_longest_outputs_steps_count_speculations_tokens():
    """A step may accept 1 + k tokens, so the longest output needs ceil(out / (1 + k)) weight reads at the least: the
    estimate stays a bound a speculating run cannot pass (single stream read 156-177% of the old one)."""
    machine = roofline.Machine(1e9, 1e-6)  # compute free, 1 KB/s: the tiny weights take seconds a read
    plain = roofline.workload_bound(_config(), torch.float32, [(10, 128)], machine)
    speculating = roofline.workload_bound(_config(), torch.float32, [(10, 128)], machine, tokens_per_step=5)
    weights = roofline.weight_bytes(_config(), torch.float32, False) / 1e3
    assert weights > 1
    assert plain["longest_output_steps_s"] == round(128 * weights, 2)
    assert speculating["longest_output_steps_s"] == round(26 * weights, 2)  # ceil(128 / 5)
    assert speculating["bound_s"] < plain["bound_s"] == plain["longest_output_steps_s"]


def _config() -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, head_dim=4, hidden_size=8,
                           intermediate_size=16, num_hidden_layers=2, vocab_size=32)
