"""30 layers of SmolLM2's 4-bit matmuls, each weight distinct (streamed from DRAM, as in a decode step)."""
import time, torch
from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight
torch.set_num_threads(2)
ext = kernels.load()
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = []
for l in range(30):
    for n, k in shapes:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        s = (torch.rand(n, k // 32) * 0.01).half().float(); m = (-torch.rand(n, k // 32) * 0.05).half().float()
        ws.append(Int4Weight(q, s, m, ext))
nbytes = sum(w.form[0].numel() + w.form[1].numel() * 4 for w in ws)
xs = {r: {k: torch.randn(r, k).bfloat16() for _, k in shapes} for r in (1, 2, 4, 8)}
def run(rows):
    for w in ws: w.mm(xs[rows][w.form[0].shape[1] * 32])
for rows in (1, 2, 4, 8, 1, 2):
    run(rows)
    best = 1e9
    for _ in range(10):
        t = time.perf_counter(); run(rows); best = min(best, time.perf_counter() - t)
    print(f"rows {rows}: {best*1e3:.2f} ms for {nbytes/1e6:.1f} MB -> {nbytes/best/1e9:.1f} GB/s", flush=True)
nbytes4 = nbytes // 4
bigf = torch.empty(nbytes4, dtype=torch.float32).normal_()
for _ in range(5):
    t = time.perf_counter(); bigf.sum(); dt = time.perf_counter() - t
    print(f"fp32 sum read {nbytes / dt / 1e9:.1f} GB/s ({dt * 1e3:.2f} ms)")
