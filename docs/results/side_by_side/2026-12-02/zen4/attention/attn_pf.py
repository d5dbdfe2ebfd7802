import torch, time, sys
from pagedllm.model.attention import paged_attention
torch.set_num_threads(2); torch.manual_seed(0)
H, KV, D, bs = 9, 3, 64, 16
L = int(sys.argv[1]) if len(sys.argv) > 1 else 1900
chunks = [(0, 1024), (1024, L)]
nb = (L + bs - 1) // bs
kc = (torch.randn(nb, bs, KV, D) * 0.5).bfloat16(); vc = torch.randn(nb, bs, KV, D).bfloat16()
bt = torch.arange(nb, dtype=torch.int32)[None]
tot = 0.0; flops = 0
for a, b in chunks:
    n = b - a
    q = torch.randn(n, H, D).bfloat16()
    args = (q, kc, vc, bt, torch.tensor([b], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), D ** -0.5, n)
    for _ in range(2): paged_attention(*args)
    reps = int(__import__("os").environ.get("REPS", 5)); s = time.perf_counter()
    for _ in range(reps): paged_attention(*args)
    t = (time.perf_counter() - s) / reps
    f = sum(a + i + 1 for i in range(n)) * H * D * 2 * 2
    tot += t; flops += f
    print(f"chunk {a}-{b}: {t*1e3:.2f} ms, {f/t/1e9:.0f} GFLOP/s")
print(f"prompt of {L}: {tot*1e3:.2f} ms per layer, {flops/tot/1e9:.0f} GFLOP/s (causal flops); x30 layers = {tot*30*1e3:.0f} ms")
