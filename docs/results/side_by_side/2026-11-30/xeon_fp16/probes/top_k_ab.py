"""The greedy logits pass (top_k.cpp) alone, before against after, alternated call by call: rows x 49,152 fp32 logits,
k = 20 (what a step with logprobs asks) and 1, 2 threads, best and median of ROUNDS.
usage: python top_k_ab.py ROOT ROUNDS (ROOT/before, ROOT/after: copies of top_k.cpp with vec16.h and exp2_poly.h;
ROOT/top_k_binding.cpp from tests/model until c23c35b:
`git show c23c35b^:tests/model/top_k_binding.cpp`)"""
import sys
import time

import torch
from torch.utils.cpp_extension import load

root, rounds = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(2)
exts = {v: load(name=f"topk_{v}", sources=[f"{root}/top_k_binding.cpp", f"{root}/{v}/top_k.cpp"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                extra_include_paths=[f"{root}/{v}"]) for v in ("before", "after")}
g = torch.Generator().manual_seed(0)
for rows in (1, 64, 256):
    x = torch.randn(rows, 49152, generator=g) * 3
    for k in (1, 20):
        outs = {v: e.top_k_logsumexp(x, k) for v, e in exts.items()}
        assert all(torch.equal(a, b) for a, b in zip(outs["before"], outs["after"]))
        t = {v: [] for v in exts}
        for _ in range(rounds):
            for v, e in exts.items():
                s = time.perf_counter()
                e.top_k_logsumexp(x, k)
                t[v].append(time.perf_counter() - s)
        line = "  ".join(f"{v} min {min(ts) * 1e3:.3f} p50 {sorted(ts)[len(ts) // 2] * 1e3:.3f} ms"
                         for v, ts in t.items())
        print(f"rows {rows:3d} k {k:2d}: {line}")
