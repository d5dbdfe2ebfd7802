"""One prompt's attention through each kernel, forced: 512 and 2,048 tokens, the default model's heads (9/3 x 64),
fp32 queries over a bf16 cache (what --dtype auto runs on CPUs without BF16), blocks of 16; ms per layer call, the
fastest of 5 after a warm-up. Run as AVX2 with docs/scripts/as_avx2.py.
usage: python prompt_tile.py"""
import time

import torch

from pagedllm.model.attention import AttentionRoute, cpp_attention

torch.manual_seed(0)
torch.set_num_threads(2)
H, KVH, D, BS = 9, 3, 64, 16
for n in (512, 2048):
    blocks = n // BS
    k, v = (torch.randn(blocks, BS, KVH, D).to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(blocks).int().view(1, -1)
    q = torch.randn(n, H, D)
    lens, starts = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    cells = []
    for name, cut in (("rows", 1 << 30), ("tiled", 1)):
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            cpp_attention(q, k, v, table, lens, starts, D ** -0.5, n, AttentionRoute(cut, cut))
            times.append(time.perf_counter() - t0)
        cells.append(f"{name} {min(times[1:]) * 1e3:.2f} ms")
    print(f"a prompt of {n} tokens: " + ", ".join(cells), flush=True)
