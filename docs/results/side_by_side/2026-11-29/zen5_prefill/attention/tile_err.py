"""Error of the tiled kernel (bf16 q over a bf16 cache) and the row kernel against dense fp32 attention."""
import sys

import torch

sys.path.insert(0, "tests/model")  # run from the repo root
from test_attention import MIXED, ROWS, TILE, dense_attention, make_batch  # noqa: E402

for seed in range(3):
    b = make_batch(MIXED + [(700, 700)], 9, 3, 64, 16, torch.bfloat16, seed=seed)
    ref = dense_attention(b)
    for name, k in (("tile", TILE), ("rows", ROWS)):
        out = b.run(tile_min_rows=k).float()
        err = (out - ref).abs()
        print(f"seed {seed} {name}: max {err.max():.2e} mean {err.mean():.2e}")
