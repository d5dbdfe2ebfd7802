"""The lm_head's two int8 paths called as the kernel table times them (each making its own output), in a built
engine, at 64 and 128 rows, twice each in turn: each call's time and the page faults it took. The first call at a
new row count faults its output's pages in.
    python first_calls.py
"""
import resource
import time

import torch

from pagedllm import LLM

engine = LLM(kv_cache_memory="1GiB", num_speculative_tokens=0).engine
model = engine.runner.model
w = model.lm_head_weight
if w.int8.q_t is None:
    w.int8.q_t = w.int8.int8_rows().t()  # torch._int_mm's form, as Int8Weight makes it
for rows in (64, 128, 64, 128, 128, 128):
    x = torch.randn(rows, 576).to(model.lm_head.dtype)
    cells = []
    for p in ("int8", "int8_mm", "int8", "int8_mm"):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        w.mm(x, path=p)
        ms = (time.perf_counter() - start) * 1e3
        cells.append(f"{p} {ms:.2f} ms, {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0} faults")
    print(f"{rows} rows: " + " | ".join(cells), flush=True)
