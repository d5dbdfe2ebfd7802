import statistics, time, torch
from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight
ext = kernels.load(); torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
def make(n, k):
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.02).half().float()
    min_ = (-torch.rand(n, k // 32, generator=g) * 0.16).half().float()
    return Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
for (n, k) in [(64, 64), (128, 576), (576, 576), (3072, 576)]:
    w = make(n, k); x = torch.randn(1, k)
    for path in ["mm_q8", "mm"]:
        f = getattr(w, path)
        for _ in range(100): f(x)
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(1000): f(x)
            ts.append((time.perf_counter() - t) / 1000)
        print(f"{n}x{k} {path:6s} {statistics.median(ts)*1e6:7.1f} us per call (warm)")
x = torch.randn(1, 64)
for _ in range(100): torch.relu(x)
t = time.perf_counter()
for _ in range(10000): torch.relu(x)
print(f"torch.relu 1x64: {(time.perf_counter()-t)/10000*1e6:.1f} us")
