"""Where the 4-bit kernel stops paying: one decode step of BATCH sequences (~300 tokens of context each) of the
default model with every layer matmul on the int4 kernel vs on the bf16 one (layers.INT4_MAX_ROWS set past the
batch, or to 0), the two alternating step by step, best of 10 each:
    python docs/scripts/int4_rows.py 1 4 8 12 16 20 24 32
"""

import random
import sys
import time

import pagedllm.model.layers as layers
from pagedllm import LLM, SamplingParams

engine = LLM(kv_cache_memory="2GiB").engine
rng = random.Random(0)
print("| batch | int4 kernel ms | bf16 matmul ms | int4 / bf16 |")
print("|---:|---:|---:|---:|")
for batch in map(int, sys.argv[1:]):
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", [rng.randrange(100, 40000) for _ in range(300)],
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    while engine.scheduler.waiting or not all(g.is_decoding for g in engine.scheduler.running):
        engine.step()  # the prompts' prefill
    for _ in range(3):
        engine.step()
    best = {"int4": float("inf"), "bf16": float("inf")}
    for _ in range(10):
        for mode, rows in (("int4", 1 << 20), ("bf16", 0)):
            layers.INT4_MAX_ROWS = rows
            start = time.perf_counter()
            engine.step()
            best[mode] = min(best[mode], time.perf_counter() - start)
    print(f"| {batch} | {best['int4'] * 1e3:.1f} | {best['bf16'] * 1e3:.1f} | {best['int4'] / best['bf16']:.2f} |")
    for request_id in list(engine.groups):
        engine.abort_request(request_id)
