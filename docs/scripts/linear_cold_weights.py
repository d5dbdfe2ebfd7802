"""The default model's 120 layer matmuls at M rows through oneDNN's packed bf16 matmul, their weights from memory
(30 layers of distinct weights, as in a decode step: "cold") against the 4 weights of one layer repeated 30 times
(in the caches: "hot"). Best of 7 passes, ms:
    python docs/scripts/linear_cold_weights.py THREADS ROWS     e.g. 2 64
"""

import sys
import time

import torch

from pagedllm.model.layers import PackedWeight, linear

threads, rows = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]
weights = [PackedWeight(torch.randn(n, k).bfloat16()) for _ in range(30) for (n, k) in SHAPES]
x = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}


def cold() -> None:
    for w, (_, k) in zip(weights, SHAPES * 30):
        linear(x[k], w)


def hot() -> None:
    for w, (_, k) in zip(weights[:4] * 30, SHAPES * 30):
        linear(x[k], w)


for name, run in (("cold", cold), ("hot", hot)):
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    print(f"{threads} threads, {rows} rows, {name}: {best * 1e3:.1f} ms")
