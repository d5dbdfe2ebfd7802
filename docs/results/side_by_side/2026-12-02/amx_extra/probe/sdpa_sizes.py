import time, torch
import torch.nn.functional as F
torch.set_num_threads(2)
for n in (512, 1900):
    for dt in (torch.bfloat16, torch.float32):
        q = torch.randn(1, 9, n, 64, dtype=dt); k = torch.randn(1, 3, n, 64, dtype=dt); v = torch.randn(1, 3, n, 64, dtype=dt)
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
            f = lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
            for _ in range(3): f()
            t = time.perf_counter(); r = 10
            for _ in range(r): f()
            print(n, dt, "gqa" if gqa else "expanded", f"{(time.perf_counter()-t)/r*1e3:.2f} ms")
