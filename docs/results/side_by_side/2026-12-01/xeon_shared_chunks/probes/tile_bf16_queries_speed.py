"""The tiled attention kernel alone with bf16 queries over a bf16 cache, in the FORM given (pairs: vdpbf16ps; fp32),
on one N-token prompt (9/3 heads x 64, blocks of 16 in random order): the fastest and the median of REPS calls.

    python tile_bf16_queries_speed.py N REPS FORM   (from /tmp with PYTHONSAFEPATH=1; PYTHONPATH picks the tree)

On 2026-12-01 (Intel Xeon model 207, no AMX), N=1900, fp32: 20.7-20.9 ms median at 81f6098, 16.4-17.3 at f01910e;
pairs 29.0-30.0.
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
q = (torch.randn(n, H, D) * 3).bfloat16()
forms = {"pairs": AttentionRoute(1, 1, True, False), "fp32": AttentionRoute(1, 1, False, False)}; route = forms[sys.argv[3]]
for _ in range(3): cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route)
ts = []
for _ in range(reps):
    t = time.perf_counter(); cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route); ts.append(time.perf_counter() - t)
ts.sort(); print(f"bf16 queries, {sys.argv[3]} tile {n}: min {ts[0]*1e3:.2f} med {ts[len(ts)//2]*1e3:.2f} ms")
