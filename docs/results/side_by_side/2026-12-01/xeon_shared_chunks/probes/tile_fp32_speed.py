"""The tiled attention kernel's fp32 form alone, fp32 queries over a bf16 cache, on one N-token prompt (9/3 heads x
64, blocks of 16 in random order): the fastest and the median of REPS calls.

    python tile_fp32_speed.py N REPS   (from /tmp with PYTHONSAFEPATH=1; PYTHONPATH picks the tree)

On 2026-12-01 (Intel Xeon model 207, no AMX), medians: N=1900 21.2-21.7 ms at 81f6098, 18.5-18.8 at f01910e; N=8192
379-384 against 307-327; as AVX2 (docs/scripts/as_avx2.py) 35.7-38.3 against 33.9-34.6.
"""
import sys, time, torch
from pagedllm.model.attention import cpp_attention, AttentionRoute
torch.manual_seed(0)
n = int(sys.argv[1]); reps = int(sys.argv[2])
H, KVH, D, BS = 9, 3, 64, 16
nb = (n + BS - 1) // BS
kc = torch.randn(nb, BS, KVH, D).to(torch.bfloat16); vc = torch.randn(nb, BS, KVH, D).to(torch.bfloat16)
table = torch.randperm(nb).to(torch.int32).unsqueeze(0)
lens = torch.tensor([n], dtype=torch.int32); starts = torch.tensor([0, n], dtype=torch.int32)
q = torch.randn(n, H, D) * 3
route = AttentionRoute(1, 1, True, False)
for _ in range(3): cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route)
ts = []
for _ in range(reps):
    t = time.perf_counter(); cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route); ts.append(time.perf_counter() - t)
ts.sort(); print(f"fp32 tile {n}: min {ts[0]*1e3:.2f} med {ts[len(ts)//2]*1e3:.2f} ms")
