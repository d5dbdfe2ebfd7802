"""The C++ GEMM kernels alone: bf16_gemm on the default model's layer shapes and int8_gemm on its lm_head, per row
count, in us per call and GFLOP/s (GOP/s for int8). Each bf16 call runs on one of 24 packed copies in turn, so the
weights come from memory as in a step; the lm_head (27 MiB in int8) does anyway. Best of several passes.

    python docs/scripts/gemm_kernels_speed.py [ROWS ...]                  # the checkout on PYTHONPATH
    PYTHONPATH=/work/wt/base python docs/scripts/gemm_kernels_speed.py   # another checkout's kernels

Timings on a shared machine are noisy: compare two checkouts by alternating runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Bf16Weight, Int8Weight

LAYERS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [out, in]
LM_HEAD = (49152, 576)
COPIES = 24


def best_of(run: Callable[[], object], passes: int, calls: int = 1) -> float:
    """Seconds per call: the fastest of `passes` runs of `run`, which makes `calls` calls."""
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    torch.set_num_threads(2)
    ext = kernels.load()
    rows = [int(r) for r in sys.argv[1:]] or [16, 64, 90, 128, 256]
    print(f"kernels from {kernels.__file__}, 2 threads")
    print("| kernel | shape | rows | us per call | GFLOP/s |\n|---|---|---:|---:|---:|")
    for name, (n, k) in LAYERS.items():
        weights = [Bf16Weight.pack(torch.randn(n, k).bfloat16()).contiguous() for _ in range(COPIES)]
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            for w in weights[:3]:
                ext.bf16_gemm(x, w)
            t = best_of(lambda x=x, ws=weights: [ext.bf16_gemm(x, w) for w in ws], 5, COPIES)
            print(f"| bf16_gemm | {name} {n}x{k} | {m} | {t * 1e6:.1f} | {2 * m * n * k / t / 1e9:.0f} |")
    n, k = LM_HEAD
    packed = Int8Weight.pack(torch.randint(-127, 128, (n, k), dtype=torch.int8)).contiguous()
    col_scale = torch.rand(n)
    for m in rows:
        q, row_scale = ext.quantize_rows_int8(torch.randn(m, k))
        out = torch.empty(m, n)
        ext.int8_gemm(q, packed, row_scale, col_scale, None, out)
        t = best_of(lambda q=q, s=row_scale, o=out: ext.int8_gemm(q, packed, s, col_scale, None, o), 7)
        print(f"| int8_gemm | lm_head {n}x{k} | {m} | {t * 1e6:.1f} | {2 * m * n * k / t / 1e9:.0f} |")


if __name__ == "__main__":
    main()
