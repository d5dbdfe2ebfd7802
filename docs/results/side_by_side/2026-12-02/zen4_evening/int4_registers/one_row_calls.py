"""The 4-bit kernel's per-call cost at 1 row against its size: ext.int4_linear called directly, 1 and 2 threads,
one weight repeated (in cache). Run with PYTHONPATH on a checkout of the commit before to time the old kernel."""
import time, torch
from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight
ext = kernels.load()
def weight(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    return Int4Weight(q, torch.rand(n, k // 32) * 0.01, -torch.rand(n, k // 32) * 0.01, ext)
def best_us(fn, n=3000):
    b = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n): fn()
        b = min(b, (time.perf_counter() - t) / n)
    return b * 1e6
for threads in (1, 2):
    torch.set_num_threads(threads)
    for n, k in ((16, 32), (64, 64), (576, 576), (960, 576), (576, 1536), (3072, 576)):
        w = weight(n, k)
        x = torch.randn(1, k).to(torch.bfloat16)
        p, s, m = w.form
        us = best_us(lambda: ext.int4_linear(x, p, s, m))
        print(f"threads {threads} {n}x{k}: {us:.1f} us  ({n*k/us/1e3:.2f} G weights/s)")
    x = torch.randn(1, 16).to(torch.bfloat16)
    print(f"threads {threads} x.add_(0): {best_us(lambda: x.add_(0)):.1f} us")
