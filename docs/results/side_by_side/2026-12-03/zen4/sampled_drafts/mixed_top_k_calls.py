"""The sampler's cost per call when only some rows have a top_k (the others top_p alone): the kernels cut every row
in one call (csrc/sampling.cpp: a top_k row by nth_element, then its top_p), torch sorts every row. Real logits of the
default model (captured as in ../sampling/sampler_calls.py), 8 and 64 rows, the two forms alternating ABBA.
Run: python mixed_top_k_calls.py WORKLOAD.jsonl
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sampling"))
from captured_logits import decode_logits  # noqa: E402

from pagedllm import SamplingParams  # noqa: E402
from pagedllm.model import kernels  # noqa: E402
from pagedllm.model.sampler import SamplingBatch, sample  # noqa: E402

logits = decode_logits(sys.argv[1])
vocab = logits.shape[1]
print(f"logits: {tuple(logits.shape)} {logits.dtype}; threads {torch.get_num_threads()}")
ext = kernels.load()
for top_k in (20, 50):
    for rows in (8, 64):
        params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=top_k if r % 2 == 0 else 0) for r in range(rows)]
        batch = SamplingBatch.build(params, [[]] * rows, [[]] * rows, [None] * rows, vocab)
        x = logits[:rows]
        times = {"torch": [], "kernels": []}
        for rep in range(40):
            for form in (("torch", "kernels") if rep % 2 == 0 else ("kernels", "torch")):
                t = time.perf_counter()
                sample(x, batch, None, ext if form == "kernels" else None)
                times[form].append(time.perf_counter() - t)
        a, b = (statistics.median(times[f]) * 1e3 for f in ("torch", "kernels"))
        print(f"half the rows top_k {top_k}, all top_p 0.95, rows {rows:3d}: torch {a:7.2f} ms, kernels {b:7.2f} ms, "
              f"ratio {b / a:.2f}x")
