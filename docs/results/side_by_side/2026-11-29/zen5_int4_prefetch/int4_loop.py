import statistics
import time

import torch

from pagedllm import LLM
from pagedllm.model.layers import linear

KINDS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
llm = LLM(kv_cache_memory="256MiB", threads=2)
m = llm.engine.runner.model
layers = m.layers
dt = layers[0].qkv_weight.int4.dtype
step = [(getattr(layer, k), k) for layer in layers for k in KINDS]
for rows in (1, 4, 8):
    xs = {k: torch.randn(rows, getattr(layers[0], k).shape[1]).to(dt) for k in KINDS}
    h = torch.randn(rows, 576).to(dt)
    ts = []
    for _ in range(40):
        t = time.perf_counter()
        for w, k in step:
            w.int4.mm(xs[k])
        ts.append(time.perf_counter() - t)
        linear(h, m.lm_head_weight)
    print(f"rows {rows}: median {statistics.median(ts[5:]) * 1e3:.3f} ms best {min(ts) * 1e3:.3f} ms")
