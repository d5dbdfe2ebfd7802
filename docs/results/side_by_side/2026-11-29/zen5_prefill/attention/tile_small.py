"""Tiled kernel on small tiles: draft verification (n queries over a 300-token context) and whole short prompts."""
import sys
import time

import torch

sys.path.insert(0, "tests/model")  # run from the repo root: python docs/results/.../tile_small.py
from test_attention import TILE, make_batch  # noqa: E402

torch.set_num_threads(2)
for name, specs in (("verify 64 x (300, 8)", [(300, 8)] * 64), ("verify 64 x (300, 4)", [(300, 4)] * 64),
                    ("prompts 16 x (160, 160)", [(160, 160)] * 16), ("prompts 4 x (700, 700)", [(700, 700)] * 4)):
    b = make_batch(specs, 9, 3, 64, 16, torch.bfloat16)
    for _ in range(3):
        b.run(tile_min_rows=TILE)
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        b.run(tile_min_rows=TILE)
        ts.append(time.perf_counter() - t)
    print(f"{name}: {sorted(ts)[len(ts) // 2] * 1e3:.3f} ms (median of 20)")
