"""`bench latency --quick` and `bench attention --quick` on tiny sizes, and the step timers on their own.
Only behaviour is asserted (keys, consistency of the numbers, timers removed after), never a timing."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import FAKE_GFLOPS, faked_machine

from pagedllm.bench.latency import plan_case
from pagedllm.bench.roofline import Machine, decode_bound
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.step_timers import PARTS
from pagedllm.entrypoints.cli import main
from pagedllm.model import llama, model_runner
from pagedllm.model.tokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def latency_result(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("latency")
    with faked_machine(out):
        assert main(["bench", "latency", "--quick", "--model", tiny_model_dir, "--dtype", "float32",
                     "--output-json", str(out / "latency.json"), "--plot", str(out / "latency.png")]) == 0
    assert (out / "latency.png").stat().st_size > 0
    return json.loads((out / "latency.json").read_text())


def test_latency_json_has_a_row_per_batch_and_context(latency_result):
    r = latency_result
    assert r["machine"]["peak_gflops"] == FAKE_GFLOPS and r["machine"]["source"].startswith("measured here")
    assert {"model", "dtype", "threads", "machine", "steps", "loadavg_before", "loadavg_after", "skipped"} <= r.keys()
    assert r["steps"] == 3 and not r["skipped"]
    assert r["num_speculative_tokens"] == 0  # a decode step is one token a sequence unless speculation is asked for
    assert [(row["batch"], row["ctx"]) for row in r["rows"]] == [(1, 32), (1, 64), (8, 32), (8, 64)]


def test_latency_parts_add_up_to_the_step(latency_result):
    for row in latency_result["rows"]:
        parts = row["parts_ms"]
        assert set(parts) == {*PARTS, "other"}
        assert all(v >= -1e-3 for v in parts.values()), parts  # rounding to 4 decimals only
        assert sum(parts.values()) == pytest.approx(row["timed_step_ms"], abs=0.01)
        assert sum(v for p, v in parts.items() if p != "other") <= row["timed_step_ms"] + 0.01
        assert parts["linear"] > 0 and parts["attention"] > 0 and parts["sampling"] > 0
        # every decoder layer's four projections, one attention per layer, a detokenizer step per sequence
        calls = row["calls_per_step"]
        assert calls["linear"] == 2 * 4 and calls["attention"] == 2 and calls["detokenize"] == row["batch"]


def test_latency_rates_and_bounds_are_consistent(latency_result):
    for row in latency_result["rows"]:
        assert row["step_ms"] > 0 and row["prefill_s"] > 0 and row["prefill_steps"] >= 1
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / row["step_ms"] * 1e3, rel=1e-3)
        assert row["prefill_tokens_per_s"] == pytest.approx(row["batch"] * row["ctx"] / row["prefill_s"], rel=1e-2)
        assert row["ctx"] < row["mean_context_len"] < row["ctx"] + 20
        b = row["bound"]
        assert b["ms"] == pytest.approx(b["linear_ms"] + b["kv_ms"], abs=1e-3) and b["kv_ms"] > 0
        assert b["tokens_per_s"] == pytest.approx(row["batch"] / b["ms"] * 1e3, rel=1e-2)


@pytest.mark.slow
def test_latency_with_speculation_counts_the_tokens_its_steps_make(tmp_path):
    """Asked for, speculation makes up to 1 + k tokens a sequence a step (the real model's greedy output on random
    prompts loops, so the proposals are taken): the run is sized for them (it used to end the sequences before the
    timed steps did and stop with 'the KV cache is too small') and tokens/s counts them. The tiny random model never
    loops, hence the real one."""
    with faked_machine(tmp_path):
        assert main(["bench", "latency", "--batch-sizes", "8", "--context-lens", "128", "--steps", "5",
                     "--num-speculative-tokens", "4", "--output-json", str(tmp_path / "spec.json")]) == 0
    r = json.loads((tmp_path / "spec.json").read_text())
    assert r["num_speculative_tokens"] == 4 and not r["skipped"]
    (row,) = r["rows"]
    per_step = row["tokens_per_s"] * row["step_ms"] / 1e3
    assert 8 * 1.1 < per_step <= 5 * 8 * 1.001


def test_decode_bound_counts_weights_flops_and_kv():
    config = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=1000)
    params = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128) + 1000 * 64
    machine = Machine(peak_gflops=1.0, mem_gbps=1.0)
    small = decode_bound(config, torch.float32, 1, 100, machine)
    assert small["weight_bytes"] == 4 * params and small["linear_flops"] == 2 * params
    assert small["kv_bytes"] == 100 * 2 * 2 * 32 * 4
    bf16_cache = decode_bound(config, torch.float32, 1, 100, machine, kv_bytes_per_token=2 * 2 * 32 * 2)
    assert bf16_cache["kv_bytes"] == small["kv_bytes"] // 2 and bf16_cache["kv_ms"] == small["kv_ms"] / 2
    assert small["linear_ms"] == pytest.approx(4 * params / 1e9 * 1e3, rel=1e-3)  # memory-bound at batch 1
    big = decode_bound(config, torch.bfloat16, 64, 100, machine)
    assert big["linear_ms"] == pytest.approx(2 * 64 * params / 1e9 * 1e3, rel=1e-3)  # compute-bound
    int8_head = decode_bound(config, torch.float32, 1, 100, machine, int8_head=True)  # a byte a head weight
    assert int8_head["weight_bytes"] == small["weight_bytes"] - 3 * 1000 * 64
    int4 = decode_bound(config, torch.bfloat16, 1, 100, machine, int4=True)  # layers: 4 bits + fp16 scale, min
    assert int4["weight_bytes"] == round((params - 1000 * 64) * (0.5 + 4 / 32) + 1000 * 64 * 2)
    assert decode_bound(config, torch.bfloat16, 64, 100, machine, int4=True) == big  # the int4 kernel: few rows only


def test_plan_case_leaves_room_for_decodes_during_prefill():
    case = plan_case(batch=8, ctx=100, steps=5, warmup=2, budget=64, kv_bytes_per_token=10)
    assert case.tokens_per_seq >= 100 + math.ceil(800 / 56) + 2 + 10
    assert case.kv_bytes == 8 * case.tokens_per_seq * 10
    speculating = plan_case(batch=8, ctx=100, steps=5, warmup=2, budget=64, kv_bytes_per_token=10, tokens_per_step=5)
    assert speculating.tokens_per_seq >= 100 + 5 * (math.ceil(800 / 56) + 2 + 10)


def test_step_timers_replace_nothing_and_turn_off(tiny_model_dir):
    """The timers reach the parts through the engine's own hooks: no module function or method is replaced while
    they run, every part of a decode step is counted, and nothing is timed once the block is left."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=64))
    model = engine.runner.model
    names = (llama.linear, llama.StepAttention.__call__, model_runner.sample, model_runner.SamplingBatch,
             IncrementalDetokenizer.step, llama.rotate_and_store)
    methods = (vars(engine).keys(), vars(engine.scheduler).keys(), vars(model).keys())
    before = tuple(set(m) for m in methods)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0))
    with engine.step_timers() as timers:
        assert (llama.linear, llama.StepAttention.__call__, model_runner.sample, model_runner.SamplingBatch,
                IncrementalDetokenizer.step, llama.rotate_and_store) == names
        assert tuple(set(m) for m in methods) == before
        while engine.has_unfinished_requests():
            engine.step()
    assert timers.calls["schedule"] > 0 and timers.calls["logits"] == 4 and timers.calls["linear"] == 4 * 2 * 4
    assert all(timers.calls[p] > 0 for p in PARTS), timers.calls
    engine.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0.0))
    calls = dict(timers.calls)
    while engine.has_unfinished_requests():
        engine.step()
    assert timers.calls == calls  # off after the block


def test_bench_attention_quick(tmp_path):
    path = tmp_path / "attention.json"
    assert main(["bench", "attention", "--quick", "--threads", "1", "--repeats", "2", "--output-json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {(r["kind"], r["dtype"]) for r in rows} == {(k, d) for k in ("decode", "prefill")
                                                        for d in ("float32", "bfloat16")}
    for r in rows:
        assert all(r[f"{v}_ms"] > 0 for v in ("cpp", "cpp_consecutive", "reference", "sdpa"))
        assert r["paging_cost"] == pytest.approx(r["cpp_ms"] / r["cpp_consecutive_ms"], rel=1e-2)
        assert r["cpp_over_sdpa"] == pytest.approx(r["cpp_ms"] / r["sdpa_ms"], rel=1e-2)
        assert r["same_output_consecutive"]  # same kernel, same keys and values, only the blocks moved
        tol = 1e-4 if r["dtype"] == "float32" else 5e-2
        assert max(r["max_abs_diff"].values()) < tol, r["max_abs_diff"]
