"""The sampler's cost per call on real logits, torch paths against the kernels' (csrc/sampling.cpp).

Captures the logits of SmolLM2-135M-Instruct (the embedded default) for the first 64 requests of workload W (the
last 64 rows the sampler saw),
then times `sample` on 1, 8 and 64 of those rows, for three sampling settings, alternating the two forms ABBA.
Run: python sampler_calls.py WORKLOAD.jsonl
"""

import statistics
import sys
import time

import torch
from captured_logits import decode_logits

from pagedllm import SamplingParams
from pagedllm.model import kernels
from pagedllm.model.sampler import SamplingBatch, sample

logits = decode_logits(sys.argv[1])
vocab = logits.shape[1]
print(f"logits: {tuple(logits.shape)} {logits.dtype}; threads {torch.get_num_threads()}")
ext = kernels.load()
for settings, name in ((dict(temperature=0.8), "temperature 0.8"),
                       (dict(temperature=0.8, top_p=0.95), "temperature 0.8, top_p 0.95"),
                       (dict(temperature=0.8, top_k=50, top_p=0.95), "temperature 0.8, top_k 50, top_p 0.95")):
    for rows in (1, 8, 64):
        batch = SamplingBatch.build([SamplingParams(**settings)] * rows, [[]] * rows, [[]] * rows, [None] * rows,
                                    vocab)
        x = logits[:rows]
        times = {"torch": [], "kernels": []}
        for rep in range(40):
            for form in (("torch", "kernels") if rep % 2 == 0 else ("kernels", "torch")):
                t = time.perf_counter()
                sample(x, batch, None, ext if form == "kernels" else None)
                times[form].append(time.perf_counter() - t)
        a, b = (statistics.median(times[f]) * 1e3 for f in ("torch", "kernels"))
        print(f"{name:40s} rows {rows:3d}: torch {a:7.2f} ms, kernels {b:7.2f} ms, ratio {b / a:.2f}x")
x = logits.float() / 0.8
ext.truncate_(x, None, torch.full((x.shape[0],), 0.95))
n = torch.isfinite(x).sum(-1).float()
print(f"top_p 0.95 at temperature 0.8 keeps per row: median {n.median():.0f}, p90 {n.quantile(0.9):.0f}, "
      f"max {n.max():.0f} tokens")
