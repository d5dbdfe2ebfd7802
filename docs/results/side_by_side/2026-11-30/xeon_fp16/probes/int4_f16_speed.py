"""The 4-bit kernels of an fp32 model against oneDNN's fp32 matmul on the default model's layer shapes: int4_linear_f32
(exact), int4_linear_f16 (fp16 products) and oneDNN on the dequantized weights; best of 7, alternated call by call,
2 threads. `check` prints each kernel's relative error against float64 beside bf16 rounding's.

    python docs/results/side_by_side/2026-11-30/xeon_fp16/probes/int4_f16_speed.py check speed
"""
import math
import sys
import time

import torch

from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ext = kernels.load()


def weight(n: int, k: int):
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half().float()
    mn = (-8 * d * (0.8 + 0.4 * torch.rand(n, k // 32, generator=g))).half().float()
    w = (q.float().view(n, k // 32, 32) * d[..., None] + mn[..., None]).view(n, k)
    return Int4Weight(q, d, mn, ext, torch.float32, f16=True), w


def check() -> None:
    for kind, (n, k) in SHAPES.items():
        form, w = weight(n, k)
        for rows in (1, 5, 16, 67):
            x = torch.randn(rows, k)
            x[:, 7] *= 30  # an outlier channel
            ref = x.double() @ w.double().T
            bf16 = x.bfloat16().double() @ w.bfloat16().double().T
            err = {name: float((y.double() - ref).norm() / ref.norm()) for name, y in
                   (("fp32", form.mm(x)), ("fp16", form.mm_f16(x)), ("bf16 rounding", bf16))}
            print(f"{kind} {rows} rows: " + "  ".join(f"{name} {e:.2e}" for name, e in err.items()))


def speed(threads: int = 2, reps: int = 7) -> None:
    torch.set_num_threads(threads)
    for kind, (n, k) in SHAPES.items():
        form, w = weight(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        for rows in (16, 64, 256, 1024):
            x = torch.randn(rows, k)
            calls = {"int4 fp32": lambda x=x, form=form: form.mm(x),
                     "int4 fp16": lambda x=x, form=form: form.mm_f16(x),
                     "onednn fp32": lambda x=x, packed=packed: torch.ops.mkldnn._linear_pointwise(
                         x, packed, None, "none", [], "")}
            best = dict.fromkeys(calls, math.inf)
            for call in calls.values():
                call()
            for _ in range(reps):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    best[name] = min(best[name], time.perf_counter() - start)
            print(f"{kind:8s} {rows:5d} rows: " + "  ".join(
                f"{name} {t * 1e3:7.3f} ms ({2 * rows * n * k / t / 1e9:4.0f} GFLOP/s)" for name, t in best.items()),
                f" fp16/fp32 {best['int4 fp32'] / best['int4 fp16']:.2f}x")


if "check" in sys.argv:
    check()
if "speed" in sys.argv:
    speed()
