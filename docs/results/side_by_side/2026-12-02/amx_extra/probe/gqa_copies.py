"""Flash attention on a 1,024-token prompt (9 query heads, 3 kv heads): the route's _sequence (public SDPA,
enable_gqa on views) against the private op on keys copied per query head, from a strided (gathered) view or
prebuilt."""
import time, math, torch
import torch.nn.functional as F
torch.set_num_threads(2)
from pagedllm.model import attention_sdpa as A
# the private op the first version called (it returns the log-sum-exp too; it has no enable_gqa)
A._flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
def tm(f, r=10):
    for _ in range(3): f()
    t = time.perf_counter()
    for _ in range(r): f()
    return round((time.perf_counter()-t)/r*1e3, 3)
H, KVH, D, BS, n = 9, 3, 64, 16, 1024
nb = n // BS
kc = torch.randn(nb + 5, BS, KVH, D).bfloat16(); vc = torch.randn(nb + 5, BS, KVH, D).bfloat16()
bt = torch.randperm(nb + 5)[:nb].int().unsqueeze(0)
q = torch.randn(n, H, D).bfloat16()
blocks = bt[0].long()
qq = q.transpose(0, 1).unsqueeze(0)
kg = kc[blocks].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0); vg = vc[blocks].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
k = kg.repeat_interleave(3, 1); v = vg.repeat_interleave(3, 1)
for i in range(2):
    print("_sequence", tm(lambda: A._sequence(q, kc, vc, bt[0], n, 0.125)))
    print("flash prebuilt", tm(lambda: A._flash(qq, k, v, 0.0, True, scale=0.125)))
    print("sdpa gqa strided", tm(lambda: F.scaled_dot_product_attention(qq, kg, vg, is_causal=True, enable_gqa=True)))
    print("flash on strided kg expanded", tm(lambda: A._flash(qq, kg.repeat_interleave(3, 1), vg.repeat_interleave(3, 1), 0.0, True, scale=0.125)))
    qc = torch.randn(1, H, n, D).bfloat16()
    print("flash contiguous q", tm(lambda: A._flash(qc, k, v, 0.0, True, scale=0.125)))
