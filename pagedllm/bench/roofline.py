"""The machine's limit: peak matmul and memory speed, and what they allow a decode step or a whole workload (a
roofline estimate that benchmarks print beside what they measured). The speeds are this machine's: measured once per
CPU model, ISA flags, threads and torch, and cached beside the kernel table (model/machine_cache.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.model import machine_cache
from pagedllm.model.layers import INT4_MAX_ROWS, Int4Weight, PackedWeight

ASSUMED_MEM_GBPS = 20.0  # bench latency's bandwidth beside a --peak-gflops given by hand (nothing measured then)
MACHINE_CACHE = "roofline"  # the cache file's prefix, beside dispatch's "kernels"

# One measurement of this machine: dtype name -> {"<dtype>_gflops": ..., "copy_gbps": ...}. Tests pass fakes.
Measure = Callable[[str], dict[str, float]]


@dataclass
class Machine:
    peak_gflops: float  # matmul, in the model's dtype
    mem_gbps: float  # memory bandwidth (bytes read + written per second)
    measured: dict[str, float] | None = None  # what the measurement found
    source: str = "assumed"  # where the figures come from: measured here, cached (file), or assumed


def call_times(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure_machine(size: int = 2048, copy_bytes: int = 512 << 20, repeats: int = 3,
                    dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> dict[str, float]:
    """Best-of-`repeats` GFLOP/s of a size^3 matmul in each of `dtypes` as the engine runs it (oneDNN's packed
    matmul: bf16 widened to fp32 where the CPU has no bf16 arithmetic, not torch's emulated 0.3 GFLOP/s on Zen 3), and
    GB/s of a large tensor copy (read + write), with torch's current threads."""
    def best(fn: Callable[[], object]) -> float:
        return min(call_times(fn, repeats))

    result = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        a, b = torch.randn(size, size).to(dtype), PackedWeight(torch.randn(size, size).to(dtype))
        result[f"{name}_gflops"] = round(2 * size ** 3 / best(lambda a=a, b=b: b.mm(a, path="onednn")) / 1e9, 1)
    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)
    result["copy_gbps"] = round(2 * copy_bytes / best(lambda: dst.copy_(src)) / 1e9, 1)
    return result


def measure_peak(dtype_name: str) -> dict[str, float]:
    return measure_machine(dtypes=(dtype_name,))


def cache_key(dtype_name: str) -> dict[str, str]:
    """What a cached measurement must match ("matmul": timed on oneDNN's packed matmul, not torch's)."""
    return {**machine_cache.machine_key(), "measure": "roofline", "dtype": dtype_name, "matmul": "packed"}


def local_machine(dtype_name: str, refresh: bool = False, measure: Measure | None = None) -> Machine:
    """This machine's peak matmul rate in `dtype_name` and copy bandwidth: cached for its CPU model, ISA flags,
    threads and torch, else measured here (about a second in fp32) and cached unless other processes took a quarter
    of a core or more meanwhile (machine_cache's rule, the kernel table's too: such a figure is a time slice's, not the
    machine's)."""
    key = cache_key(dtype_name)
    file = machine_cache.cache_file(key, MACHINE_CACHE)
    cached = None if refresh else machine_cache.load_json(file, key)
    if cached is not None and isinstance(cached.get("measured"), dict):
        measured, source = cached["measured"], f"measured here earlier, cached at {file}"
        return Machine(measured[f"{dtype_name}_gflops"], measured["copy_gbps"], measured, source)
    start = machine_cache.cpu_sample()
    measured = (measure or measure_peak)(dtype_name)
    load, others = machine_cache.machine_load(), round(machine_cache.others_since(start), 2)
    if machine_cache.quiet(load, others):
        machine_cache.save_json(file, {"key": key, "measured": measured, "others_cpu": others})
        source = f"measured here, cached at {file}"
    else:
        source = f"measured here while other processes used {others:.2f} CPUs, not cached"
    return Machine(measured[f"{dtype_name}_gflops"], measured["copy_gbps"], measured, source)


def layer_params(config: Any) -> int:
    """Weights of every layer's linear projections (qkv, o, gate_up, down): what a decode step reads besides the
    lm_head."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return config.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def weight_bytes(config: Any, dtype: torch.dtype, int4: bool, int8_head: bool = False) -> float:
    """Bytes a step reads for the weights: the layers' in 4 bits plus a scale and min per group when the int4
    kernel serves them, else in the dtype; the lm_head in the dtype, or a byte a weight where it has an int8 form."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_weight = Int4Weight.BYTES_PER_WEIGHT if int4 else elem
    return layer_params(config) * per_weight + config.vocab_size * config.hidden_size * (1 if int8_head else elem)


def kv_token_bytes(config: Any, dtype: torch.dtype) -> int:
    """One token's K and V over every layer, stored in `dtype`."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * elem


def decode_bound(config: Any, dtype: torch.dtype, batch: int, context_tokens: float, machine: Machine,
                 int4: bool = False, kv_bytes_per_token: int | None = None, int8_head: bool = False,
                 ) -> dict[str, float]:
    """The fastest a decode step of `batch` sequences holding `context_tokens` tokens in all can run here: every
    linear weight (lm_head included) read once or its FLOPs at peak, whichever is slower, plus the KV cache read.
    `int4`: the engine has 4-bit layer weights, which it reads instead at up to INT4_MAX_ROWS rows.
    `kv_bytes_per_token`: the cache's own (a bf16 or int8 cache under an fp32 model); else the model dtype's.
    `int8_head`: the lm_head has an int8 form (weight_bytes)."""
    params = layer_params(config) + config.vocab_size * config.hidden_size
    weights, flops = weight_bytes(config, dtype, int4 and batch <= INT4_MAX_ROWS, int8_head), 2 * batch * params
    kv_bytes = context_tokens * (kv_bytes_per_token or kv_token_bytes(config, dtype))
    linear_ms = 1e3 * max(weights / (machine.mem_gbps * 1e9), flops / (machine.peak_gflops * 1e9))
    kv_ms = 1e3 * kv_bytes / (machine.mem_gbps * 1e9)
    return {"weight_bytes": round(weights), "linear_flops": flops, "kv_bytes": round(kv_bytes),
            "linear_ms": round(linear_ms, 4), "kv_ms": round(kv_ms, 4), "ms": round(linear_ms + kv_ms, 4),
            "tokens_per_s": round(batch / (linear_ms + kv_ms) * 1e3, 1)}


def workload_bound(config: Any, dtype: torch.dtype, requests: list[tuple[int, int]], machine: Machine,
                   int4: bool = False, kv_bytes_per_token: int | None = None, tokens_per_step: int = 1,
                   int8_head: bool = False) -> dict:
    """A machine-limit estimate for an offline workload of (prompt tokens, output tokens) requests: every token's
    linear FLOPs (the lm_head for output tokens only) at peak, plus each decode's read of its context's K/V at memory
    bandwidth; and never less than the longest output's decode steps, each reading every weight once (4-bit layer
    weights with `int4`: the last steps run few sequences), at most `tokens_per_step` tokens a step (1 + the
    speculative tokens: a step may accept them all)."""
    layers, head = layer_params(config), config.vocab_size * config.hidden_size
    prompt, output = sum(p for p, _ in requests), sum(o for _, o in requests)
    flops = 2 * layers * (prompt + output) + 2 * head * output
    kv_read = sum(o * p + o * (o - 1) // 2 for p, o in requests) * (  # context read per decode
        kv_bytes_per_token or kv_token_bytes(config, dtype))
    compute_s = flops / (machine.peak_gflops * 1e9)
    kv_s = kv_read / (machine.mem_gbps * 1e9)
    steps = math.ceil(max((o for _, o in requests), default=0) / tokens_per_step)
    steps_s = steps * weight_bytes(config, dtype, int4, int8_head) / (machine.mem_gbps * 1e9)
    bound_s = max(compute_s + kv_s, steps_s)
    return {"peak_gflops": machine.peak_gflops, "mem_gbps": machine.mem_gbps, "source": machine.source,
            "compute_s": round(compute_s, 2),
            "kv_read_s": round(kv_s, 2), "longest_output_steps_s": round(steps_s, 2), "bound_s": round(bound_s, 2),
            "output_tokens_per_s": round(output / bound_s, 1) if bound_s else None}
