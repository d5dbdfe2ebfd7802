"""A 49,152 x 576 fp32 weight to int8 rows: torch's w / scale (Int8Weight before 2026-11-30) against the C++
quantize_rows_int8 (w * (1 / scale), as activations are), and how many values the two roundings give differently;
torch's one-call transpose beside it. Inside heap.build_in_heap, as in a build."""
import time

import torch

from pagedllm.model import heap, kernels

torch.set_num_threads(2)
ext = kernels.load()
with heap.build_in_heap():
    w = torch.randn(49152, 576, generator=torch.Generator().manual_seed(0)) * 0.05
    for _ in range(3):
        start = time.perf_counter()
        scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).contiguous()
        q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        in_torch = time.perf_counter() - start
        start = time.perf_counter()
        q2, scale2 = ext.quantize_rows_int8(w)
        in_cpp = time.perf_counter() - start
        differ = int((q.int() - q2.int()).abs().sum())
        print(f"torch {in_torch:.3f} s, C++ {in_cpp:.3f} s; values differing by one step: {differ}; "
              f"scales equal: {torch.equal(scale, scale2)}")
