"""The bf16 int4 kernel alone, weights resident in cache (one weight called repeatedly) and streamed (120 distinct)."""
import sys, time, torch
from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight
threads = int(sys.argv[1]); torch.set_num_threads(threads)
ext = kernels.load()
n, k = 3072, 576
q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
s = (torch.rand(n, k // 32) * 0.01).half().float(); m = (-torch.rand(n, k // 32) * 0.05).half().float()
w = Int4Weight(q, s, m, ext)
tg = (n // 16) * (k // 32)
for rows in (1, 2, 3, 4, 5, 6, 8):
    x = torch.randn(rows, k).bfloat16()
    for _ in range(200): w.mm(x)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(500): w.mm(x)
        best = min(best, (time.perf_counter() - t) / 500)
    print(f"{threads} threads, rows {rows}: {best*1e6:6.1f} us, {best*1e9/(tg/threads):6.1f} ns per tile-group per thread, {best*1e9/(tg/threads)/rows:5.1f} per row")
