"""The attention route's measurement on the default model's shape (9/3 heads x 64, fp32 queries, bf16 cache): the
counts each regime timed, in order (regime:rows@seconds), the seconds, the route and each count's row / tiled ms per
call. Usage: attn_measure.py BUDGET..."""
import sys
import time

import torch

from pagedllm.model import attention_dispatch as ad


def recording(order: list, t0: float):
    def timer(what, kernel, rows, run):
        s = time.perf_counter()
        run()
        e = time.perf_counter()
        if not order or order[-1][:2] != (what, rows):
            order.append((what, rows, round(e - t0, 2)))
        return e - s
    return timer


torch.set_num_threads(2)
shape = ad.AttentionShape(9, 3, 64, torch.float32, torch.bfloat16, 16)
for budget in [float(b) for b in sys.argv[1:]]:
    order: list = []
    with torch.inference_mode():
        table = ad.measure(shape, recording(order, time.perf_counter()), budget)
    print(f"budget {budget}: {table.seconds:.2f} s; {table.summary()}")
    print("   order:", " ".join(f"{w}:{r}@{a}" for w, r, a in order))
    for r in ad.REGIMES:
        print(f"   {r}: " + " ".join(f"{n}:{t1 * 1e3:.1f}/{t2 * 1e3:.1f}" for n, t1, t2 in
                                     zip(table.rows[r], table.times[r]["rows"], table.times[r]["tile"])))
