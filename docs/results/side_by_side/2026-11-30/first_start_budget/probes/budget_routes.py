"""How the matmul table's routes depend on the measuring budget, and which row counts each budget timed (kind:
rows@seconds since the start, when that row count's first call ended). Usage: budget_routes.py BUDGET..."""
import sys
import time

import torch

from pagedllm.bench.kernels import build_untuned
from pagedllm.config import EngineConfig
from pagedllm.model import dispatch


def recording(order: list, t0: float):
    def timer(kind, path, rows, run):
        s = time.perf_counter()
        run()
        e = time.perf_counter()
        if not order or order[-1][:2] != (kind, rows):
            order.append((kind, rows, round(e - t0, 2)))
        return e - s
    return timer


torch.set_num_threads(2)
runner, name = build_untuned(EngineConfig())
weights, dtype = runner.model.packed_weights(), runner.model.dtype
budgets = [float(b) for b in sys.argv[1:]] or [1.0, 1.5, 2.0, 2.5, 8.0]
for _ in range(2):
    for budget in budgets:
        order: list = []
        with torch.inference_mode():
            table = dispatch.measure(weights, dtype, recording(order, time.perf_counter()), budget)
        print(f"budget {budget}: {table.seconds:.2f} s; {table.summary()}")
        seq: dict = {}
        for kind, rows, at in order:
            seq.setdefault(kind, []).append(f"{rows}@{at}")
        for kind, s in seq.items():
            print(f"   {kind}: {' '.join(s)}")
        sys.stdout.flush()
