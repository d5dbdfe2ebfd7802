"""The fused C++ kernels of csrc/fused_ops.cpp at the default model's shapes (SmolLM2-135M: hidden 576,
intermediate 1536, 9 query heads of 64), bf16, 2 threads, for M = 1 ... 1024 rows: `add_rms_norm` [M, 576] (with
the residual add), `silu_mul` [M, 3072] -> [M, 1536] and `rotary_` on q [M, 9, 64] (a strided view of the qkv
rows, as in the model). Per call, median (best) in us over 7 rounds of interleaved calls.

    python docs/scripts/fused_ops_speed.py

It times whichever checkout is first on the path (printed first): to compare two versions, run it with
PYTHONPATH set to each in turn, alternating, on an otherwise idle machine.
"""

from __future__ import annotations

import statistics
import time

import torch

import pagedllm
from pagedllm.model import kernels

ROWS = (1, 16, 64, 193, 1024)
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def calls(ext, m: int) -> dict:
    g = torch.Generator().manual_seed(m)
    x, residual = (torch.randn(m, HIDDEN, generator=g).bfloat16() for _ in range(2))
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).bfloat16()
    gate_up = (torch.randn(m, 2 * INTER, generator=g) * 3).bfloat16()
    qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).bfloat16()
    q = qkv[:, :HEADS * HEAD_DIM].view(m, HEADS, HEAD_DIM)
    cos, sin = (torch.randn(8192, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
    positions = torch.randint(0, 8192, (m,), generator=g)
    # the norm adds x into the residual each call: the values drift, the work does not
    return {"add_rms_norm": lambda: ext.add_rms_norm(x, residual, weight, 1e-5),
            "silu_mul": lambda: ext.silu_mul(gate_up),
            "rotary_ q": lambda: ext.rotary_(q, cos, sin, positions)}


def per_call_us(fns: dict, n: int, rounds: int = 7) -> dict[str, list[float]]:
    """Each function's per-call times, the functions taking turns round by round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(n):
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e6)
    return times


def main() -> None:
    torch.set_num_threads(2)
    ext = kernels.load()
    if ext is None:
        raise SystemExit(f"kernels did not build: {kernels.build_error()}")
    print(f"pagedllm from {pagedllm.__file__}; bf16, 2 threads; us per call, median (best)")
    names = list(calls(ext, 1))
    print(f"| {'M':>5} | " + " | ".join(f"{name:>16}" for name in names) + " |")
    print(f"|{'-' * 7}|" + "|".join("-" * 18 for _ in names) + "|")
    for m in ROWS:
        times = per_call_us(calls(ext, m), n=max(20, 4000 // m))
        cells = [f"{statistics.median(times[name]):7.1f} ({min(times[name]):6.1f})" for name in names]
        print(f"| {m:>5} | " + " | ".join(f"{cell:>16}" for cell in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
