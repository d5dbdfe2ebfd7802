"""int4_q8 at 1 row over a decode step's 120 layer matmuls (random weights, default model's shapes), several builds of
int4_linear_q8.cpp alternated in one process; ms per step (median)."""
import statistics, sys, time
import torch
from torch.utils.cpp_extension import load
from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight

VARIANTS = {"main": ("/work/main/pagedllm/model/csrc", [])}
for i, flag in enumerate(sys.argv[2].split(",")):
    VARIANTS[f"v{i}{flag}"] = ("/tmp/wt/onerow/pagedllm/model/csrc", [flag] if flag else [])
mods = {}
for name, (src, flags) in VARIANTS.items():
    mods[name] = load(name=f"q8var_{name.strip('-=').replace('-', '_').replace('=', '_')}", sources=[f"{src}/int4_linear_q8.cpp", "/tmp/exp/var/bind.cpp"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp", f"-I{src}"] + flags,
                      extra_ldflags=["-fopenmp"], verbose=False)
ext = kernels.load()
torch.set_num_threads(2)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
g = torch.Generator().manual_seed(0)
layers = []
for _ in range(30):
    ws = {}
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.02).half().float()
        min_ = (-torch.rand(n, k // 32, generator=g) * 0.16).half().float()
        ws[name] = Int4Weight(q, scale, min_, ext, torch.float32, q8=True).f32_layout
    layers.append(ws)
for rows in [int(r) for r in sys.argv[1].split(',')]:
    xs = {name: torch.randn(rows, k, generator=g) for name, (n, k) in SHAPES.items()}
    ref = {name: mods["main"].int4_linear_q8(xs[name], *layers[0][name]) for name in SHAPES}
    for v, m in mods.items():
        for name in SHAPES:
            assert torch.equal(m.int4_linear_q8(xs[name], *layers[0][name]), ref[name]), (v, name)
    times = {v: [] for v in mods}
    for it in range(int(sys.argv[3]) if len(sys.argv) > 3 else 40):
        for v, m in mods.items():
            t = time.perf_counter()
            for ws in layers:
                for name, w in ws.items():
                    m.int4_linear_q8(xs[name], *w)
            times[v].append(time.perf_counter() - t)
    base = statistics.median(times["main"])
    print(f"rows {rows}: " + "  ".join(f"{v} {statistics.median(t)*1e3:.3f} ({statistics.median(t)/base:.2f}x)" for v, t in times.items()))
