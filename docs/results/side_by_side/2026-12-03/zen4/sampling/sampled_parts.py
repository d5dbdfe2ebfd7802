"""Where a sampled step's logits and sampler time goes, op by op, on the default model's own logits at 64 rows
(temperature 0.8, top_p 0.95): compute_logits' search for its 16 rescored candidates and its fp32 copy (torch's topk
against the one-pass kernel), then the sampler's steps; the ops alternate in ABBA order.
Run: python sampled_parts.py WORKLOAD.jsonl
"""

import statistics
import sys
import time

import torch
from captured_logits import decode_logits

from pagedllm.model import kernels

logits = decode_logits(sys.argv[1])
ext = kernels.load()
rows = logits.shape[0]
temperature = torch.full((rows,), 0.8)
top_p = torch.full((rows,), 0.95)
u = torch.rand(rows)
x = logits / temperature[:, None]
masked = x.clone()
ext.truncate_(masked, None, top_p)
ops = {
    "divide by temperature": lambda: logits / temperature[:, None],
    "clone, then truncate_ (top_p 0.95)": lambda: ext.truncate_(x.clone(), None, top_p),
    "clone alone": lambda: x.clone(),
    "draw_rows": lambda: ext.draw_rows(masked, u),
    "logsumexp (top_k_logsumexp k=1)": lambda: ext.top_k_logsumexp(logits, 1),
    "torch topk 16 (compute_logits)": lambda: logits.topk(16, dim=-1),
    "top_k_logsumexp k=16": lambda: ext.top_k_logsumexp(logits, 16),
    "bf16 -> fp32 (.float())": lambda: logits.bfloat16().float(),
}
times = {name: [] for name in ops}
for rep in range(30):
    for name, op in (ops.items() if rep % 2 == 0 else reversed(ops.items())):
        t = time.perf_counter()
        op()
        times[name].append(time.perf_counter() - t)
print(f"logits {tuple(logits.shape)}, threads {torch.get_num_threads()}")
for name, ts in times.items():
    print(f"{name:35s} {statistics.median(ts) * 1e3:7.2f} ms")
