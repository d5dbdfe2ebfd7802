"""A bf16 model's 4-bit matmul forms, the kernels alone (medians of 15, us): the bf16 kernel (vdpbf16ps), int4_f16 on fp32 rows converted around the call, int4_f16 on bf16 rows, oneDNN bf16, bf16_gemm. Run: PYTHONPATH=TREE python probe_bf16_f16.py"""
import time, torch, sys
from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight, Bf16Weight
from pagedllm.model.layers import PackedWeight
torch.set_num_threads(2)
ext = kernels.load()
g = torch.Generator().manual_seed(0)
def q4(n, k):
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.08).half().float()
    return q, s, m
def best(f, n=15):
    f(); f()
    t = []
    for _ in range(n):
        a = time.perf_counter(); f(); t.append(time.perf_counter() - a)
    t.sort(); return t[len(t)//2] * 1e6
for (n, k) in [(960, 576), (3072, 576), (576, 1536)]:
    q, s, m = q4(n, k)
    wb = Int4Weight(q, s, m, ext, torch.bfloat16)
    wf = Int4Weight(q, s, m, ext, torch.float32, f16=True)
    wbf = Int4Weight(q, s, m, ext, torch.bfloat16, f16=True)
    plain = (q.float().view(n, k // 32, 32) * s[..., None] + m[..., None]).view(n, k)
    pw = PackedWeight(plain.bfloat16(), bf16=Bf16Weight(plain.bfloat16(), ext))
    for rows in (1, 8, 16, 64, 128, 256):
        x = torch.randn(rows, k, generator=g).bfloat16()
        r = {"int4": best(lambda: wb.mm(x)),
             "int4_f16(x.float)": best(lambda: wf.mm_f16(x.float()).bfloat16()),
             "int4_f16 bf16": best(lambda: wbf.mm_f16(x)),
             "onednn": best(lambda: pw.mm(x, path="onednn")),
             "bf16_gemm": best(lambda: pw.mm(x, path="bf16_gemm"))}
        print(f"{n}x{k} rows {rows:4d} " + "  ".join(f"{a} {b:8.1f}" for a, b in r.items()), flush=True)
