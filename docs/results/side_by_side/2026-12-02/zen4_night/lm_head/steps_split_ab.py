"""A decode step of BATCH sequences (~300 tokens of context, no drafts), the lm_head's outlier split as before
(torch ops picking the channels, their rows of the plain weight gathered each call) against split_outliers_int8 with
the rows read in place, alternating step by step in one engine; median and best of STEPS
(default 40) each, in a fixed order (STEPS set: ABBA):
    python steps_ab.py 1 4 16 64
"""
import os
import random
import statistics
import sys
import time

import torch

from pagedllm import LLM, SamplingParams

engine = LLM(kv_cache_memory="2GiB", num_speculative_tokens=0).engine
model = engine.runner.model
head = model.lm_head_weight.int8
ext = head.ext
print("lm_head route:", model.lm_head_weight.route, "outliers:", head.outliers)

def before(x, bias=None, kernel=None, out=None):
    kernel = head.packed is not None if kernel is None else kernel
    ch = x.abs().amax(dim=0).topk(head.outliers).indices
    big, rest = x.index_select(1, ch).float(), x.index_fill(1, ch, 0)
    w = head.plain_t.index_select(0, ch)
    q, scale = ext.quantize_rows_int8(rest.contiguous(), ext.int8_gemm_input_max() if kernel else 127)
    out = x.new_empty(x.shape[0], head.out_features) if out is None else out
    if kernel:
        ext.int8_gemm(q, head.packed, scale, head.scale, bias, out, big, w)
        return out
    for cols in head.blocks:
        ext.dequantize_int32(torch._int_mm(q, head.q_t[:, cols]), scale, head.scale[cols],
                             None if bias is None else bias[cols], out[:, cols], big, w[:, cols])
    return out

STEPS = int(os.environ.get("STEPS", "40"))  # steps of each side per batch
ABBA = "STEPS" in os.environ  # the first runs (40 steps) kept one order; later ones alternate it
rng = random.Random(0)
print("| batch | now ms (median, best) | before ms (median, best) | now / before (medians) |")
print("|---:|---:|---:|---:|")
for batch in map(int, sys.argv[1:]):
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", [rng.randrange(100, 40000) for _ in range(300)],
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    while engine.scheduler.waiting or not all(g.is_decoding for g in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = {"now": [], "before": []}
    for n in range(STEPS):
        for side in (list(times) if n % 2 == 0 or not ABBA else list(times)[::-1]):
            if side == "before":
                head.mm = before
            else:
                head.__dict__.pop("mm", None)
            start = time.perf_counter()
            engine.step()
            times[side].append(time.perf_counter() - start)
    head.__dict__.pop("mm", None)
    n, o = (statistics.median(times[s]) * 1e3 for s in ("now", "before"))
    best = {s: min(times[s]) * 1e3 for s in times}
    print(f"| {batch} | {n:.2f}, {best['now']:.2f} | {o:.2f}, {best['before']:.2f} | {n / o:.3f} |", flush=True)
    for request_id in list(engine.groups):
        engine.abort_request(request_id)
