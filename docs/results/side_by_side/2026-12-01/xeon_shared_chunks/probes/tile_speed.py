"""The tiled attention kernel alone on one N-token prompt (9/3 heads x 64, a bf16 cache in blocks of 16 taken in random
order), in FORM (f16: fp16 products, fp32 queries only; fp32; pairs: vdpbf16ps, bf16 queries only) with QUERIES
(fp32 or bf16): the fastest and the median of REPS calls after 3 warm-ups.

    python tile_speed.py N REPS FORM QUERIES   (from /tmp with PYTHONSAFEPATH=1; PYTHONPATH picks the tree)

On 2026-12-01 (Intel Xeon model 207, AVX512-FP16, no AMX, nothing else running), medians:
  f16 fp32, N=1900: 13.34-13.41 ms at 6378665, 11.76-11.95 at 14a14a7 (the shared fp16 chunks); N=8192 253.6-262.8
    against 214.1-217.3
  fp32 fp32, N=1900: 21.2-21.7 ms at 81f6098, 18.5-18.8 at f01910e (the shared fp32 rows); N=8192 379-384 against
    307-327; as AVX2 (docs/scripts/as_avx2.py) 35.7-38.3 against 33.9-34.6
  fp32 bf16, N=1900: 20.7-20.9 ms at 81f6098, 16.4-17.3 at f01910e; pairs bf16 29.0-30.0
"""
import sys
import time

import torch

from pagedllm.model.attention import AttentionRoute, cpp_attention

n, reps, form, queries = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.manual_seed(0)
H, KVH, D, BS = 9, 3, 64, 16
nb = (n + BS - 1) // BS
kc, vc = (torch.randn(nb, BS, KVH, D).to(torch.bfloat16) for _ in range(2))
table = torch.randperm(nb).to(torch.int32).unsqueeze(0)
lens, starts = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
q = (torch.randn(n, H, D) * 3).to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[queries]))
route = AttentionRoute(1, 1, form == "pairs", form == "f16")
for _ in range(3):
    cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route)
times = []
for _ in range(reps):
    start = time.perf_counter()
    cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route)
    times.append(time.perf_counter() - start)
times.sort()
print(f"{form} tile, {queries} queries, {n} tokens: min {times[0] * 1e3:.2f} ms, "
      f"median {times[len(times) // 2] * 1e3:.2f}")
