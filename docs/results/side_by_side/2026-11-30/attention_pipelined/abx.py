"""Decode attention alone, variant against variant: copies of pagedllm/model/csrc (folders under ROOT, default
/tmp/attn: `before` = the commit before, `after` = this one) built with tests/model/attention_binding.cpp (until
c23c35b: `git show c23c35b^:tests/model/attention_binding.cpp`), S sequences x T keys over L layers' caches (past
the L3 at 30), SmolLM2's 9 heads / 3 kv heads / 64 dims, a bf16 cache in shuffled blocks of a POOL-block pool per
layer on 2 MB pages, fp32 queries (QDTYPE=bfloat16: bf16 ones), variants alternated call by call.

usage: [QDTYPE=bfloat16] python abx.py VARIANTS THREADS S T L ROUNDS   (e.g. before,after 2 64 300 30 12)"""
import os
import sys
import time

import torch
from torch.utils.cpp_extension import load

from pagedllm.model.prefault import advise_huge_pages

ROOT = os.environ.get("ROOT", "/tmp/attn")
torch.set_num_threads(int(sys.argv[2]))
variants = sys.argv[1].split(",")
S, T, layers, reps = (int(x) for x in sys.argv[3:7])
exts = {v: load(name=f"attn_{v}", sources=[f"{ROOT}/attention_binding.cpp", f"{ROOT}/{v}/paged_attention.cpp"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"]) for v in variants}
H, KV, D, B = 9, 3, 64, 16
nb = max(S * ((T + B - 1) // B) + 8, int(os.environ.get("POOL", "12000")))
g = torch.Generator().manual_seed(0)


def cache() -> torch.Tensor:
    t = torch.empty(nb, B, KV, D, dtype=torch.bfloat16)
    assert advise_huge_pages([t])
    return t.copy_(torch.randn(nb, B, KV, D, generator=g))


caches = [(cache(), cache()) for _ in range(layers)]
bt = torch.randperm(nb - 8, generator=g)[: S * ((T + B - 1) // B)].view(S, -1).to(torch.int32)
ctx = torch.full((S,), T, dtype=torch.int32)
qsl = torch.arange(S + 1, dtype=torch.int32)
q = torch.randn(S, H, D, generator=g).to(getattr(torch, os.environ.get("QDTYPE", "float32")))
ref = None
res: dict[str, list[float]] = {v: [] for v in variants}
for rnd in range(reps):
    for v in variants:
        t = time.perf_counter()
        for k, vv in caches:
            out = exts[v].paged_attention(q, k, vv, bt, ctx, qsl, 0.125, 1, 1 << 30, 1 << 30, False)
        res[v].append((time.perf_counter() - t) / layers)
        if ref is None:
            ref = out
        elif rnd == 0:
            print(v, "max difference from the first variant's output:", (out - ref).abs().max().item())
for v in variants:
    ts = sorted(res[v])
    print(f"{v}: S={S} T={T} L={layers} threads={sys.argv[2]}: min {ts[0] * 1e3:.3f} p50 {ts[len(ts) // 2] * 1e3:.3f}"
          f" ms/layer ({S * T * KV * D * 4 / ts[len(ts) // 2] / 1e9:.2f} GB/s of K+V)")
