import time

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Int4Weight

ext = kernels.load()


def t(f, n=5000):
    for _ in range(300):
        f()
    s = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - s) / n * 1e6


for N, K in ((32, 32), (576, 576), (3072, 576)):
    w = Int4Weight(
        torch.randint(0, 16, (N, K), dtype=torch.uint8),
        torch.rand(N, K // 32).half().float(),
        torch.rand(N, K // 32).half().float(),
        ext,
    )
    x = torch.randn(1, K).bfloat16()
    for th in (1, 2):
        torch.set_num_threads(th)
        print(N, K, th, "threads", f"{t(lambda w=w, x=x: w.mm(x)):.2f} us")
