"""`--dtype auto`'s bf16-or-fp32 choice (model/bf16_choice.py): driven by fake timings, cached per machine, never
bf16 where the CPU has no bf16 arithmetic."""

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.model import bf16_choice, machine_cache
from pagedllm.model.bf16_choice import torch_dtype_name

BF16_FLAGS = "avx2 avx512_bf16 avx512f fma"


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A CPU whose flags a test sets, a cache folder of its own, nothing decided yet in this process."""
    monkeypatch.setenv(machine_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(bf16_choice, "_decided", {})
    monkeypatch.setattr(machine_cache, "quiet", lambda load, others: True)

    def flags(value: str) -> None:
        monkeypatch.setattr(machine_cache, "cpu_identity", lambda: ("Some CPU", value))
    return flags


def timings(bf16_s: float, fp32_s: float, calls: list[int]):
    def measure() -> dict[str, float]:
        calls.append(1)
        return {"bfloat16": bf16_s, "float32": fp32_s}
    return measure


def unreachable() -> dict[str, float]:
    raise AssertionError("measured where the cache or the flags decide")


def test_no_bf16_arithmetic_means_fp32_without_measuring(machine):
    machine("avx2 avx512f avx512_vnni fma")
    assert bf16_choice.bf16_pays(unreachable) is False


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_bf16_where_its_matmul_is_faster_here(machine, flag):
    machine(f"avx2 {flag} fma")
    assert bf16_choice.bf16_pays(timings(0.002, 0.004, [])) is True


def test_fp32_where_bf16_flags_but_a_slower_bf16_matmul(machine):
    machine(BF16_FLAGS)  # the Intel Xeon without AMX: bf16 at 0.6x fp32's rate
    assert bf16_choice.bf16_pays(timings(0.0072, 0.0043, [])) is False


def test_the_choice_is_cached_for_the_machine_and_read_back(machine, monkeypatch):
    machine(BF16_FLAGS)
    calls: list[int] = []
    assert bf16_choice.bf16_pays(timings(0.0072, 0.0043, calls)) is False
    monkeypatch.setattr(bf16_choice, "_decided", {})  # a later process: only the file is left
    assert bf16_choice.bf16_pays(unreachable) is False
    assert bf16_choice.bf16_pays(timings(0.001, 0.004, calls), refresh=True) is True  # refresh measures again
    assert len(calls) == 2
    machine(BF16_FLAGS + " avx512_fp16")  # another CPU: its own measurement
    assert bf16_choice.bf16_pays(timings(0.0072, 0.0043, calls)) is False
    assert len(calls) == 3


def test_a_timing_taken_beside_other_processes_is_used_but_not_cached(machine, monkeypatch):
    machine(BF16_FLAGS)
    monkeypatch.setattr(machine_cache, "quiet", lambda load, others: False)
    calls: list[int] = []
    assert bf16_choice.bf16_pays(timings(0.001, 0.004, calls)) is True
    assert bf16_choice.bf16_pays(unreachable) is True  # this process keeps its decision
    monkeypatch.setattr(bf16_choice, "_decided", {})
    assert bf16_choice.bf16_pays(timings(0.0072, 0.0043, calls)) is False  # the next process measures again
    assert len(calls) == 2


def test_engine_config_auto_follows_the_measured_choice(machine, monkeypatch):
    machine(BF16_FLAGS)
    monkeypatch.setattr(bf16_choice, "measure_matmuls", timings(0.0072, 0.0043, []))
    assert torch_dtype_name(EngineConfig(dtype="auto")) == "float32"
    assert EngineConfig(dtype="auto").kv_cache_torch_dtype_name == "bfloat16"
    assert torch_dtype_name(EngineConfig(dtype="bfloat16")) == "bfloat16"  # asked for: not measured
    monkeypatch.setattr(bf16_choice, "_decided", {})
    monkeypatch.setattr(bf16_choice, "measure_matmuls", timings(0.002, 0.004, []))
    assert torch_dtype_name(EngineConfig(dtype="auto", kv_cache_dtype="float32")) == "float32"  # cached: fp32 stands
    machine(BF16_FLAGS + " amx_bf16 amx_int8 amx_tile")
    assert torch_dtype_name(EngineConfig(dtype="auto")) == "bfloat16"


def test_the_real_measurement_times_both_dtypes():
    seconds = bf16_choice.measure_matmuls()
    assert set(seconds) == {"bfloat16", "float32"} and all(0 < s < 10 for s in seconds.values())


def test_a_cached_file_without_both_timings_is_measured_again(machine):
    machine(BF16_FLAGS)
    key = bf16_choice.cache_key()
    machine_cache.save_json(machine_cache.cache_file(key, bf16_choice.CACHE_PREFIX),
                            {"key": key, "seconds": {"float32": 0.004}})
    calls: list[int] = []
    assert bf16_choice.bf16_pays(timings(0.002, 0.004, calls)) is True
    assert len(calls) == 1


def test_a_process_keeps_its_decision_when_its_threads_change(machine):
    """The thread governor moves torch's threads while an engine runs: a later ask (a benchmark's report, the KV tier's
    model identity) gets the dtype the model was built in, not a new measurement for the new thread count."""
    machine(BF16_FLAGS)
    threads = torch.get_num_threads()
    assert bf16_choice.bf16_pays(timings(0.002, 0.004, [])) is True
    try:
        torch.set_num_threads(threads + 1)
        assert bf16_choice.bf16_pays(unreachable) is True
    finally:
        torch.set_num_threads(threads)
