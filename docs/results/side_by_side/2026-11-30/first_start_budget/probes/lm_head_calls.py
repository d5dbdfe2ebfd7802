"""The lm_head at 256 rows: each path's calls in order (interleaved, as the table times them), in ms."""
import time

import torch

from pagedllm.bench.kernels import build_untuned
from pagedllm.config import EngineConfig

torch.set_num_threads(2)
runner, _ = build_untuned(EngineConfig())
w = runner.model.packed_weights()["lm_head"][0]
for rows in (256, 64):
    x = torch.randn(rows, w.shape[1])
    calls = {p: [] for p in ("onednn", "int8")}
    with torch.inference_mode():
        for _ in range(5):
            for p in calls:
                s = time.perf_counter()
                w.mm(x, path=p)
                calls[p].append(round((time.perf_counter() - s) * 1e3, 1))
    print(rows, calls)
