"""`--dtype auto`'s choice between bf16 and fp32 arithmetic, measured where the engine runs: the ISA flags do not
tell. With AVX512-BF16 and no AMX, oneDNN's bf16 matmul ran at 1.9x fp32's rate on AMD EPYC Zen 5 but 0.6x on an
Intel Xeon (model 207), where the workload ran 1.46x faster in fp32. Timed once per machine (~70 ms), cached beside
the kernel table (model/machine_cache.py)."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable

import torch

from pagedllm.config import EngineConfig
from pagedllm.model import machine_cache
from pagedllm.model.layers import PackedWeight

logger = logging.getLogger("pagedllm")

CACHE_PREFIX = "dtype"
ROWS, IN_FEATURES, OUT_FEATURES = 256, 1024, 2048  # arithmetic, not the weight's reads, bounds a call this size
DTYPES = {"float32", "bfloat16"}
SAMPLES = 3  # timed calls per dtype, alternated, after one warm-up each; the fastest counts

# One measurement: dtype name -> seconds of the call. Tests pass fakes.
Measure = Callable[[], dict[str, float]]


def bf16_flags() -> bool:
    """The CPU has bf16 arithmetic (AMX or AVX512-BF16); without it bf16 is emulated and never the fast choice."""
    _, flags = machine_cache.cpu_identity()
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def measure_matmuls() -> dict[str, float]:
    """Best-of-SAMPLES seconds of one ROWS x IN_FEATURES x OUT_FEATURES matmul in each dtype, as the engine's big
    steps run it (oneDNN's packed matmul), with torch's current threads."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(ROWS, IN_FEATURES, generator=gen), torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen)
    calls = {}
    for name in sorted(DTYPES, reverse=True):  # float32 first
        dtype = getattr(torch, name)
        weight, xs = PackedWeight(w.to(dtype)), x.to(dtype)
        calls[name] = functools.partial(weight.mm, xs, path="onednn")
        calls[name]()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(SAMPLES):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def cache_key() -> dict[str, str]:
    return {**machine_cache.machine_key(), "measure": "bf16_choice",
            "shape": f"{ROWS}x{IN_FEATURES}x{OUT_FEATURES}"}


# This process's decisions, by key but for the thread count: a start asks for the dtype many times, and a later ask,
# after the thread governor moved torch's threads, must get the dtype the model was built in.
_decided: dict[str, bool] = {}


def bf16_pays(measure: Measure | None = None, refresh: bool = False) -> bool:
    """bf16 arithmetic where the CPU has it and its matmul is faster than fp32's here (cached per CPU model, ISA
    flags, threads and torch; a timing taken while other processes held a quarter of a core is used, not cached)."""
    if not bf16_flags():
        return False
    key = cache_key()
    memo = json.dumps({k: v for k, v in key.items() if k != "threads"}, sort_keys=True)
    if memo in _decided and not refresh:
        return _decided[memo]
    file = machine_cache.cache_file(key, CACHE_PREFIX)
    cached = None if refresh else machine_cache.load_json(file, key)
    if cached is not None and isinstance(cached.get("seconds"), dict) and DTYPES <= cached["seconds"].keys():
        seconds = cached["seconds"]
    else:
        start = machine_cache.cpu_sample()
        seconds = (measure or measure_matmuls)()
        load, others = machine_cache.machine_load(), machine_cache.others_since(start)
        if machine_cache.quiet(load, others):
            machine_cache.save_json(file, {"key": key, "seconds": seconds, "others_cpu": round(others, 2)})
    pays = seconds["bfloat16"] < seconds["float32"]
    logger.info("--dtype auto: %s (a %dx%dx%d matmul: bf16 %.2f ms, fp32 %.2f ms)", "bfloat16" if pays else
                "float32 arithmetic over a bf16 KV cache", ROWS, IN_FEATURES, OUT_FEATURES,
                seconds["bfloat16"] * 1e3, seconds["float32"] * 1e3)
    _decided[memo] = pays
    return pays


def torch_dtype_name(config: EngineConfig) -> str:
    """The model's torch dtype: the one `--dtype` asks for, or under auto bf16 where bf16_pays, else fp32 (over a
    bf16 KV cache: EngineConfig.kv_cache_torch_dtype_name)."""
    return config.asked_dtype_name or ("bfloat16" if bf16_pays() else "float32")
