"""The tiled attention kernel's fp16 form alone on one N-token prompt (9/3 heads x 64, random bf16 cache in blocks
of 16 taken in random order), REPS calls after 3 warm-ups: the fastest and the median call.

    python tile_f16_speed.py N REPS   (from /tmp with PYTHONSAFEPATH=1; PYTHONPATH picks the tree)

On 2026-12-01 (Intel Xeon model 207, AVX512-FP16, no AMX, nothing else running), medians: N=1900 13.34-13.41 ms at
6378665, 11.76-11.95 at 14a14a7 (the shared chunks); N=8192 253.6-262.8 against 214.1-217.3.
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
route = AttentionRoute(1, 1, True, True)
for _ in range(3): cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route)
ts = []
for _ in range(reps):
    t = time.perf_counter(); cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route); ts.append(time.perf_counter() - t)
ts.sort(); print(f"f16 tile {n}: min {ts[0]*1e3:.2f} med {ts[len(ts)//2]*1e3:.2f} ms")
