"""The 4-bit weights' fp32 kernel (int4) against the int8-activation one (int4_q8) and torch's fp32 matmul (F.linear), on the
default model's layer shapes, alternated call by call; median ms per call.
usage: python q8_kernel_times.py [ROWS,...] [REPEATS]"""
import statistics
import sys
import time

import torch

from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16,32,64,128,256,512,1024").split(",")]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    ext = kernels.load()
    torch.set_num_threads(2)
    print(f"threads 2, q8 kernel: {ext.int4_linear_q8_supported()}")
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.02).half().float()
        min_ = (-torch.rand(n, k // 32, generator=g) * 0.16).half().float()
        weight = Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
        dense = (q.float().view(n, k // 32, 32) * scale[..., None] + min_[..., None]).view(n, k)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g)
            paths = {"int4": lambda: weight.mm(x), "int4_q8": lambda: weight.mm_q8(x),
                     "linear": lambda: torch.nn.functional.linear(x, dense)}
            times = {p: [] for p in paths}
            for fn in paths.values():
                fn()
            for _ in range(repeats):
                for p, fn in paths.items():
                    t = time.perf_counter()
                    fn()
                    times[p].append(time.perf_counter() - t)
            med = {p: statistics.median(v) * 1e3 for p, v in times.items()}
            print(f"{name:8s} rows {rows:5d}  " + "  ".join(f"{p} {m:8.3f}" for p, m in med.items())
                  + f"   q8/int4 {med['int4_q8'] / med['int4']:.2f}")


if __name__ == "__main__":
    main()
