"""The bf16 4-bit kernel's two schedules on the layer shapes of the default model and of a 1B one, at 1-64 rows:
tile by tile (PAGEDLLM_INT4_PANELS unset) against panels of 4 tiles (set to 1), each call on the next of 8 weights
(from memory, as a decode step reads them), alternated, the median of 20 passes. Against bf16_gemm on the same
shapes. usage: with tried.diff applied to csrc/int4_linear.cpp, python int4_schedules.py"""

import os
import statistics
import time

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Bf16Weight, Int4Weight

SHAPES = {"135M qkv": (960, 576), "135M gate_up": (3072, 576), "135M down": (576, 1536),
          "1B qkv": (3072, 2048), "1B gate_up": (16384, 2048), "1B down": (2048, 8192)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
LAYERS = 8


def weights(n: int, k: int, ext) -> tuple[list[Int4Weight], list[Bf16Weight]]:
    g = torch.Generator().manual_seed(n + k)
    int4, bf16 = [], []
    for _ in range(LAYERS):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
        min_ = (-torch.rand(n, k // 32, generator=g) * 0.16).half().float()
        int4.append(Int4Weight(q, scale, min_, ext))
        plain = (q.float().view(n, k // 32, 32) * scale[..., None] + min_[..., None]).view(n, k).bfloat16()
        bf16.append(Bf16Weight(plain, ext))
    return int4, bf16


def timed(run, ws, x) -> float:
    start = time.perf_counter()
    for w in ws:
        run(w, x)
    return (time.perf_counter() - start) / len(ws)


def main() -> None:
    torch.set_num_threads(2)
    ext = kernels.load()
    int4_mm = lambda w, x: w.mm(x)  # noqa: E731
    for name, (n, k) in SHAPES.items():
        int4, bf16 = weights(n, k, ext)
        for rows in ROWS:
            x = torch.randn(rows, k).bfloat16()
            got = {"tiles": [], "panels": [], "bf16_gemm": []}
            for _ in range(20):
                for variant in got:
                    os.environ.pop("PAGEDLLM_INT4_PANELS", None)
                    if variant == "panels":
                        os.environ["PAGEDLLM_INT4_PANELS"] = "1"
                    got[variant].append(timed(int4_mm if variant != "bf16_gemm" else Bf16Weight.mm,
                                              int4 if variant != "bf16_gemm" else bf16, x))
            os.environ.pop("PAGEDLLM_INT4_PANELS", None)
            same = torch.equal(int4[0].mm(x), (os.environ.update(PAGEDLLM_INT4_PANELS="1"), int4[0].mm(x))[1])
            os.environ.pop("PAGEDLLM_INT4_PANELS", None)
            med = {v: statistics.median(t) * 1e6 for v, t in got.items()}
            print(f"{name:>13} rows {rows:3d}: tiles {med['tiles']:8.1f} us  panels {med['panels']:8.1f} us  "
                  f"bf16_gemm {med['bf16_gemm']:8.1f} us  panels/tiles {med['panels'] / med['tiles']:.2f}  "
                  f"same output {same}", flush=True)


if __name__ == "__main__":
    main()
