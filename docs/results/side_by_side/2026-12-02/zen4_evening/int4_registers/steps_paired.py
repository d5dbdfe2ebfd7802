"""A decode step of BATCH sequences (~300 tokens of context, no drafts) on the 4-bit kernel of this checkout against
the same kernel from another build (OLD_SO: the compiled extension of the commit before), in one engine, the two
alternating step by step (the weights' layout is the same), median and best of 30 each:
    python steps_paired.py OLD_SO 1 2 3 4 5
"""

import importlib.util
import random
import statistics
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers import PackedWeight

spec = importlib.util.spec_from_file_location(sys.argv[1].rsplit("/", 1)[-1].split(".")[0], sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
engine = LLM(kv_cache_memory="2GiB", num_speculative_tokens=0).engine
model = engine.runner.model
int4 = [v.int4 for layer in model.layers for obj in (layer, getattr(layer, "attn", None), getattr(layer, "mlp", None))
        if obj is not None for v in vars(obj).values() if isinstance(v, PackedWeight) and v.int4 is not None]
new = int4[0].ext
print("routes:", {name: v.route for name, v in vars(model.layers[0]).items() if isinstance(v, PackedWeight)})
rng = random.Random(0)
print("| batch | new ms (median, best) | old ms (median, best) | new / old (medians) |")
print("|---:|---:|---:|---:|")
for batch in map(int, sys.argv[2:]):
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", [rng.randrange(100, 40000) for _ in range(300)],
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    while engine.scheduler.waiting or not all(g.is_decoding for g in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = {"new": [], "old": []}
    for _ in range(30):
        for side, ext in (("new", new), ("old", old)):
            for w in int4:
                w.ext = ext
            start = time.perf_counter()
            engine.step()
            times[side].append(time.perf_counter() - start)
    n, o = (statistics.median(times[s]) * 1e3 for s in ("new", "old"))
    print(f"| {batch} | {n:.2f}, {min(times['new']) * 1e3:.2f} | {o:.2f}, {min(times['old']) * 1e3:.2f} | {n / o:.2f} |")
    for request_id in list(engine.groups):
        engine.abort_request(request_id)
