"""int4_linear_f32 at 1-8 rows on the default model's layer shapes, 2 threads, weights cold (a copy per call from a
ring bigger than the L3), best of 30: ms per call and ms per row."""
import sys
import time

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Int4Weight

ext = kernels.load()
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
g = torch.Generator().manual_seed(0)
for K, N in ((576, 3072), (1536, 576), (576, 1536)):
    copies = max(2, (96 << 20) // (N * K // 2))
    ws = [Int4Weight(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g),
                     torch.rand(N, K // 32, generator=g).half().float(),
                     torch.rand(N, K // 32, generator=g).half().float(), ext, torch.float32) for _ in range(copies)]
    row = []
    for M in (1, 2, 3, 4, 8):
        x = torch.randn(M, K, generator=g)
        best = float("inf")
        for i in range(30):
            w = ws[i % copies]
            t = time.perf_counter()
            w.mm(x)
            best = min(best, time.perf_counter() - t)
        row.append(f"M={M} {best * 1e3:.3f} ms")
    print(f"{K}->{N}: " + ", ".join(row))
