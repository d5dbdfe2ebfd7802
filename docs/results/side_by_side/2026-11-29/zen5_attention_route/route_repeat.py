"""The attention route measured N times in one process on the default model's shape (9/3 heads x 64, blocks of 16;
bf16 queries over a bf16 cache unless DTYPE and KV_DTYPE say otherwise), each time's busy and few tables (ms per
call: row kernel / tiled kernel).
usage: python route_repeat.py N [DTYPE KV_DTYPE]   (e.g. 2 float32 bfloat16: what --dtype auto runs without BF16)"""
import sys

import torch

from pagedllm.model import kernels
from pagedllm.model.attention_dispatch import AttentionShape, measure

torch.set_num_threads(2)
kernels.load()
dtype, kv_dtype = (getattr(torch, name) for name in (sys.argv[2:4] or ["bfloat16", "bfloat16"]))
shape = AttentionShape(9, 3, 64, dtype, kv_dtype, 16)
for _ in range(int(sys.argv[1])):
    t = measure(shape)
    print(f"{t.seconds:.3f} s: {t.summary()}")
    for regime, rows in t.rows.items():
        cells = [f"{r}: {a * 1e3:.3f}/{b * 1e3:.3f}" for r, a, b in zip(rows, t.times[regime]["rows"],
                                                                        t.times[regime]["tile"])]
        print(f"  {regime}: " + ", ".join(cells))
