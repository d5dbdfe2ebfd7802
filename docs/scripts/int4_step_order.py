"""The default model's 120 layer matmuls at ROWS rows, timed two ways: in a step's order (layer by layer: qkv, o,
gate_up, down; 66 MB of 4-bit weights, more than the caches hold) and one kind's 30 layers at a time, each kind's
second pass timed (its 10-33 MB nearer the caches). Median and best of 12 rounds, in ms:
    python docs/scripts/int4_step_order.py 1 4 8
Against the code before a change, from a worktree of that commit:
    git worktree add /tmp/before <commit> && PYTHONPATH=/tmp/before python docs/scripts/int4_step_order.py 1 4 8
"""

import statistics
import sys
import time

import torch

from pagedllm import LLM
from pagedllm.model.layers import linear

KINDS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
layers = LLM(kv_cache_memory="256MiB").engine.runner.model.layers


def pass_ms(order: list, xs: dict) -> float:
    for _ in range(2):
        start = time.perf_counter()
        for weight, kind in order:
            linear(xs[kind], weight)
    return (time.perf_counter() - start) * 1e3


for rows in map(int, sys.argv[1:] or ["1"]):
    xs = {kind: torch.randn(rows, getattr(layers[0], kind).shape[1]) for kind in KINDS}
    step = [(getattr(layer, kind), kind) for layer in layers for kind in KINDS]
    alone = [[(getattr(layer, kind), kind) for layer in layers] for kind in KINDS]  # a kind's 30, twice, in turn
    times: dict[str, list[float]] = {"step order": [], "kind by kind": []}
    for _ in range(12):
        times["step order"].append(pass_ms(step, xs))
        times["kind by kind"].append(sum(pass_ms(order, xs) for order in alone))
    for name, ts in times.items():
        print(f"rows {rows:3d}, {name:12s}: median {statistics.median(ts):6.2f} ms, best {min(ts):6.2f} ms "
              f"({getattr(layers[0], KINDS[0]).path_for(rows)})")
