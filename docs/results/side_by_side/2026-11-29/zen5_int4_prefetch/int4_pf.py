import statistics
import time

import torch

from pagedllm import LLM

KINDS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
llm = LLM(kv_cache_memory="256MiB", threads=2)
layers = llm.engine.runner.model.layers
dt = layers[0].qkv_weight.int4.dtype
step = [(getattr(layer, k), k) for layer in layers for k in KINDS]
big = torch.ones(256 << 20, dtype=torch.uint8)
for rows in (1, 4, 8):
    xs = {k: torch.randn(rows, getattr(layers[0], k).shape[1]).to(dt) for k in KINDS}
    ts = []
    for _ in range(25):
        big.add_(1)
        t = time.perf_counter()
        for w, k in step:
            w.int4.mm(xs[k])
        ts.append(time.perf_counter() - t)
    print(f"rows {rows}: median {statistics.median(ts) * 1e3:.3f} ms best {min(ts) * 1e3:.3f} ms")
