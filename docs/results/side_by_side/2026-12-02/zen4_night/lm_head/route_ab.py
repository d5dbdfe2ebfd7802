"""A decode step of BATCH sequences (~300 tokens of context, no drafts) with the lm_head on int8_gemm at every row
count (the route the kernel table now measures) against int8_mm past 90 rows (the route the tables measured before),
alternating step by step in one engine (ABBA order); median and best of 20 each. At 64 rows the two
routes are the same: the control.
    python route_ab.py 96 128 200
"""
import random
import statistics
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers import BIGGEST

engine = LLM(kv_cache_memory="6GiB", num_speculative_tokens=0, max_num_seqs=256).engine
model = engine.runner.model
weight = model.lm_head_weight
head = weight.int8
if head.q_t is None:
    head.q_t = head.int8_rows().t()  # torch._int_mm's form, as Int8Weight makes it
routes = {"int8": ((BIGGEST, "int8"),), "int8_mm past 90": ((90, "int8"), (BIGGEST, "int8_mm"))}
print("measured route:", weight.route)
rng = random.Random(0)
print("| batch | int8 ms (median, best) | int8_mm past 90 ms (median, best) | ratio (medians) |")
print("|---:|---:|---:|---:|")
for batch in map(int, sys.argv[1:]):
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", [rng.randrange(100, 40000) for _ in range(300)],
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    while engine.scheduler.waiting or not all(g.is_decoding for g in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()
    times = {name: [] for name in routes}
    for n in range(20):
        for name, route in (routes.items() if n % 2 == 0 else reversed(routes.items())):  # ABBA: no order bias
            weight.route = route
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
    a, b = (statistics.median(times[n]) * 1e3 for n in routes)
    mins = [min(times[n]) * 1e3 for n in routes]
    print(f"| {batch} | {a:.1f}, {mins[0]:.1f} | {b:.1f}, {mins[1]:.1f} | {a / b:.3f} |", flush=True)
    for request_id in list(engine.groups):
        engine.abort_request(request_id)
