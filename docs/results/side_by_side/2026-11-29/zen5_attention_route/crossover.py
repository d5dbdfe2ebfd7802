"""The row kernel against the tiled kernel per query count, each forced: S sequences of U(100, 1000) tokens of context
(seeded), n new tokens each, 8 layers' caches used in turn; ms per layer call, the fastest of 4 after a warm-up.
usage: python crossover.py HEADS KV_HEADS S DTYPE N1,N2,...  (e.g. 9 3 32 bfloat16 1,2,4,8,16,32,45,64)"""
import sys
import time

import torch

from pagedllm.model import attention as A

torch.manual_seed(0)
torch.set_num_threads(2)
H, KVH, D, BS = int(sys.argv[1]), int(sys.argv[2]), 64, 16
S, dtype = int(sys.argv[3]), getattr(torch, sys.argv[4])
NS = [int(x) for x in sys.argv[5].split(",")]
lens = torch.randint(100, 1001, (S,))
nblk = int((lens.max() + BS - 1) // BS)
caches = []
for _ in range(8):
    kc = torch.randn(S * nblk + 1, BS, KVH, D).to(dtype)
    caches.append((kc, torch.randn_like(kc)))
perm = torch.randperm(S * nblk).view(S, nblk).int()
G = H // KVH
print(f"{S} sequences, {H}/{KVH} heads x {D}, {dtype}")
for n in NS:
    q = torch.randn(S * n, H, D).to(dtype)
    qsl = torch.arange(0, S * n + 1, n).int()
    res = {}
    for name, cut in (("rows", 10**6), ("tile", 1)):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for kc, vc in caches:
                A.cpp_attention(q, kc, vc, perm, lens.int(), qsl, 0.125, n, A.AttentionRoute(cut, cut))
            best.append((time.perf_counter() - t0) / len(caches))
        res[name] = min(best[1:]) * 1e3
    print(f"n={n:2d} rows={n * G:3d}: rows {res['rows']:.3f} ms  tile {res['tile']:.3f} ms  "
          f"tile/rows {res['tile'] / res['rows']:.2f}", flush=True)
