"""A 1-row decode's 120 layer matmuls (30 layers x qkv, o, gate_up, down; random 4-bit weights of the default
model's shapes), as a step runs them, per kernel path, alternated; against a plain read of the same bytes."""
import statistics, sys, time
import torch
from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ext = kernels.load()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
layers = []
for _ in range(30):
    ws = {}
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.02).half().float()
        min_ = (-torch.rand(n, k // 32, generator=g) * 0.16).half().float()
        ws[name] = Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
    layers.append(ws)
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
xs = {name: torch.randn(rows, k) for name, (n, k) in SHAPES.items()}
nbytes = sum(t.numel() * t.element_size() for ws in layers for w in ws.values() for t in w.form)
blob = torch.ones(nbytes // 4, dtype=torch.float32)
def step(path):
    for ws in layers:
        for name, w in ws.items():
            getattr(w, path)(xs[name])
def read():
    blob.sum()
paths = {"int4_q8": lambda: step("mm_q8"), "int4": lambda: step("mm"), "read": read}
times = {p: [] for p in paths}
for _ in range(3):
    for fn in paths.values(): fn()
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
    for p, fn in paths.items():
        t = time.perf_counter(); fn(); times[p].append(time.perf_counter() - t)
print(f"{nbytes/1e6:.1f} MB of weights (tensors of Int4Weight), rows {rows}")
for p, v in times.items():
    m = statistics.median(v)
    print(f"{p:8s} median {m*1e3:7.3f} ms  min {min(v)*1e3:7.3f}  {nbytes/m/1e9:5.1f} GB/s")
