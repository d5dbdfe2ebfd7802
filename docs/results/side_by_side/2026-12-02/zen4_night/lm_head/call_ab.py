"""The lm_head's int8 call at the default model's shape, the outlier split as before (torch ops, gathered rows)
against split_outliers_int8 + rows read in place, interleaved, caches evicted before each call."""
import statistics
import sys
import time

import torch

from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int8Weight

torch.set_num_threads(2)
ext = kernels.load()
g = torch.Generator().manual_seed(0)
weight = Int8Weight((torch.randn(49152, 576, generator=g) * 0.05).bfloat16(), ext, outliers=16, int_mm=True)
evict = torch.empty(64 << 20, dtype=torch.uint8)

def old(x, out, kernel):
    ch = x.abs().amax(dim=0).topk(16).indices
    big, rest = x.index_select(1, ch).float(), x.index_fill(1, ch, 0)
    wg = weight.plain_t.index_select(0, ch)
    q, scale = ext.quantize_rows_int8(rest.contiguous(), ext.int8_gemm_input_max() if kernel else 127)
    if kernel:
        ext.int8_gemm(q, weight.packed, scale, weight.scale, None, out, big, wg)
    else:
        for cols in weight.blocks:
            ext.dequantize_int32(torch._int_mm(q, weight.q_t[:, cols]), scale, weight.scale[cols], None,
                                 out[:, cols], big, wg[:, cols])

print("| rows | path | before ms (median) | now ms (median) | now / before |")
print("|---:|---|---:|---:|---:|")
for rows in map(int, sys.argv[1:]):
    x = torch.randn(rows, 576, generator=g)
    x[:, [7, 100, 300]] *= 25
    x = x.bfloat16()
    out = x.new_empty(rows, 49152)
    for kernel in (True, False):
        ts = {"old": [], "new": []}
        for _ in range(15):
            for side in ts:
                evict.add_(1)
                s = time.perf_counter()
                old(x, out, kernel) if side == "old" else weight.mm(x, kernel=kernel, out=out)
                ts[side].append(time.perf_counter() - s)
        o, n = (statistics.median(ts[k]) * 1e3 for k in ("old", "new"))
        print(f"| {rows} | {'int8' if kernel else 'int8_mm'} | {o:.2f} | {n:.2f} | {n / o:.2f} |", flush=True)
