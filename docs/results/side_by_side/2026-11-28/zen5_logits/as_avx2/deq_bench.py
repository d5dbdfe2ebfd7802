"""dequantize_int32 over one 64 x 4,096 column block (the int8_mm path's unit): plain, with the 16 outlier channels'
product, and plain + the bf16 addmm_ it replaced; best of 10, ms. Run directly or under docs/scripts/as_avx2.py.
"""

import timeit

import torch

from pagedllm.model import kernels

ext = kernels.load()
torch.set_num_threads(2)
print(kernels._CFLAGS, kernels.build_error())


def best_ms(fn) -> float:
    return min(timeit.repeat(fn, number=1, repeat=10)) * 1e3


S, N, E = 64, 4096, 16
acc = torch.randint(-1000, 1000, (S, N), dtype=torch.int32)
rs, cs = torch.rand(S), torch.rand(N)
out = torch.empty(S, N, dtype=torch.bfloat16)
x, w = torch.randn(S, E), torch.randn(E, N).bfloat16()
plain = best_ms(lambda: ext.dequantize_int32(acc, rs, cs, None, out))
extra = best_ms(lambda: ext.dequantize_int32(acc, rs, cs, None, out, x, w))
before = best_ms(lambda: (ext.dequantize_int32(acc, rs, cs, None, out), out.addmm_(x.bfloat16(), w)))
print(f"plain {plain:.3f}, with the outlier product {extra:.3f}, plain + addmm_ {before:.3f} ms")
