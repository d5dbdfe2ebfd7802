"""dequantize_int32 with the outlier product on fixed random inputs, saved to ARGV[1]: run once as built here and once
under docs/scripts/as_avx2.py, then compare the two files with torch.equal (the AVX2 build must give the same bits):
    python deq_bits.py /tmp/a.pt; python docs/scripts/as_avx2.py deq_bits.py /tmp/b.pt
"""

import sys

import torch

from pagedllm.model import kernels

ext = kernels.load()
gen = torch.Generator().manual_seed(3)
S, N, E = 13, 1100, 16
acc = torch.randint(-100000, 100000, (S, N), dtype=torch.int32, generator=gen)
rs, cs = torch.rand(S, generator=gen) / 100, torch.rand(N, generator=gen) / 100
x, w = torch.randn(S, E, generator=gen) * 20, torch.randn(E, N + 30, generator=gen)
outs = []
for dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                       (torch.bfloat16, torch.float32)):
    out = torch.empty(S, N, dtype=dtype)
    ext.dequantize_int32(acc, rs, cs, None, out, x, w[:, 30:].to(w_dtype))
    outs.append(out)
torch.save(outs, sys.argv[1])
print(kernels._CFLAGS)
