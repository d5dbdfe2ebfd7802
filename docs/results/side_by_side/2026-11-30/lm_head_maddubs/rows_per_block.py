"""Rows per register block of the AVX2 int8 kernel (kRows in csrc/int8_gemm.cpp): the lm_head (576 -> 49,152) through
Int8Weight.mm (activations quantised to the kernel's range, then int8_gemm), median of 7 warm calls, 2 threads, and a
check that the int32 sums are exact. Built once with kRows 4 and once with 6, the tree on PYTHONPATH.
    python rows_per_block.py"""

import time

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Int8Weight

torch.set_num_threads(2)
ext = kernels.load()
print("input max", ext.int8_gemm_input_max() if hasattr(ext, "int8_gemm_input_max") else "n/a")
g = torch.Generator().manual_seed(0)
w = torch.randn(49152, 576, generator=g) * 0.05
iw = Int8Weight(w, ext)
q = iw.int8_rows()
for rows in (1, 4, 16, 64, 128, 256):
    x = torch.randn(rows, 576, generator=g)
    iw.mm(x)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        iw.mm(x)
        ts.append(time.perf_counter() - t)
    ts.sort()
    # exactness of the integer sums
    qx, s = (ext.quantize_rows_int8(x, ext.int8_gemm_input_max()) if hasattr(ext, "int8_gemm_input_max")
             else ext.quantize_rows_int8(x))
    acc = torch.empty(rows, 49152, dtype=torch.int32)
    ext.int8_gemm(qx, iw.packed, None, None, None, acc)
    ok = torch.equal(acc.long(), qx.long() @ q.long().T)
    err = ((iw.mm(x) - x @ w.T).abs().max() / (x @ w.T).abs().max()).item()
    print(f"rows {rows}: {ts[len(ts)//2]*1e3:.2f} ms (min {ts[0]*1e3:.2f}), exact sums {ok}, rel max err {err:.4f}")
