"""The lm_head (49,152 x 576, int8_gemm on AVX2) at ROWS rows, builds of int8_gemm.cpp alternated call by call, the
weight evicted between calls by reading a 96 MB buffer (as a decode step's layers do); ms per call (median)."""
import statistics, sys, time
import torch
from torch.utils.cpp_extension import load
from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int8Weight

V = {"main": ("/work/main/pagedllm/model/csrc", []), "new": ("/tmp/wt/lmhead/pagedllm/model/csrc", [])}
mods = {k: load(name=f"i8var_{k}", sources=[f"{src}/int8_gemm.cpp", f"{src}/int8_linear.cpp", "/tmp/exp/var/bind8.cpp"],
                extra_cflags=["-O3", "-march=native", "-fopenmp", f"-I{src}"] + fl, extra_ldflags=["-fopenmp"])
        for k, (src, fl) in V.items()}
ext = kernels.load()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
w = Int8Weight(torch.randn(49152, 576, generator=g) * 0.05, ext)
blob = torch.ones(96 << 18)
for rows in [int(r) for r in sys.argv[1].split(",")]:
    x = torch.randn(rows, 576, generator=g)
    q, scale = ext.quantize_rows_int8(x, ext.int8_gemm_input_max())
    outs = {k: torch.empty(rows, 49152) for k in mods}
    times = {k: [] for k in mods}
    for it in range(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
        for k, m in mods.items():
            blob.sum()
            t = time.perf_counter()
            m.int8_gemm(q, w.packed, scale, w.scale, None, outs[k], None, None, None)
            times[k].append(time.perf_counter() - t)
    assert all(torch.equal(outs["main"], o) for o in outs.values())
    base = statistics.median(times["main"])
    print(f"rows {rows}: " + "  ".join(f"{k} {statistics.median(v)*1e3:.3f} ms ({statistics.median(v)/base:.2f}x)"
                                       for k, v in times.items()), flush=True)
