"""Decode attention of bf16 queries over a bf16 cache in its two forms, alternated call by call: scores on vdpbf16ps
(tile_pairs on) against the queries widened to fp32 (off). S sequences x T keys over L layers' caches (past the last
level cache), SmolLM2's 9 heads / 3 kv heads / 64 dims, blocks of 16 in random order of one pool per layer.
usage: python rows_form.py THREADS S T L ROUNDS   (e.g. 2 64 300 30 10)"""
import statistics
import sys
import time

import torch

from pagedllm.model import attention

threads, S, T, layers, rounds = (int(x) for x in sys.argv[1:6])
torch.set_num_threads(threads)
H, KV, D, B = 9, 3, 64, 16
per_seq = (T + B - 1) // B
nb = S * per_seq + 8
g = torch.Generator().manual_seed(0)
caches = [(torch.randn(nb, B, KV, D, generator=g).to(torch.bfloat16),
           torch.randn(nb, B, KV, D, generator=g).to(torch.bfloat16)) for _ in range(layers)]
tables = torch.randperm(nb - 8, generator=g)[: S * per_seq].view(S, -1).to(torch.int32)
ctx = torch.full((S,), T, dtype=torch.int32)
qsl = torch.arange(S + 1, dtype=torch.int32)
q = torch.randn(S, H, D, generator=g).to(torch.bfloat16)
routes = {"vdpbf16ps": attention.AttentionRoute(10**9, 10**9, True),
          "fp32": attention.AttentionRoute(10**9, 10**9, False)}
times = {name: [] for name in routes}
for _ in range(rounds):
    for name, route in routes.items():
        start = time.perf_counter()
        for k, v in caches:
            attention.cpp_attention(q, k, v, tables, ctx, qsl, D ** -0.5, 1, route)
        times[name].append((time.perf_counter() - start) * 1e3)
for name, t in times.items():
    print(f"{name:10s} {layers} layers: min {min(t):7.2f} ms, median {statistics.median(t):7.2f} ms")
