"""Variants of int4_linear_q8 against the worktree's int4 and int4_q8, call by call; median ms; checks equal output."""
import statistics
import sys
import time

import torch
from build import build

from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
rows_list = [int(r) for r in sys.argv[1].split(",")]
variants = {f.rstrip("/").split("/")[-1]: build(f) for f in sys.argv[2:]}
ext = kernels.load()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
for name, (n, k) in SHAPES.items():
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.02).half().float()
    min_ = (-torch.rand(n, k // 32, generator=g) * 0.16).half().float()
    weight = Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
    for rows in rows_list:
        x = torch.randn(rows, k, generator=g)
        paths = {"int4": lambda: weight.mm(x), "q8": lambda: weight.mm_q8(x)}
        for v, mod in variants.items():
            paths[v] = (lambda mod=mod: mod.int4_linear_q8(x, *weight.f32_layout))
            assert torch.equal(paths[v](), weight.mm_q8(x)), (v, name, rows)
        times = {p: [] for p in paths}
        for _ in range(7):
            for p, fn in paths.items():
                t = time.perf_counter()
                fn()
                times[p].append(time.perf_counter() - t)
        med = {p: statistics.median(v) * 1e3 for p, v in times.items()}
        print(f"{name:8s} {rows:5d} " + " ".join(f"{p} {m:7.3f}" for p, m in med.items()), flush=True)
