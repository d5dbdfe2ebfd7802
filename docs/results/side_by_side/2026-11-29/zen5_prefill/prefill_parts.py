"""Where a prefill's time goes: prompts of N tokens (argv: N COUNT), each step's parts under the engine's step
timers (the parts `pagedllm bench latency` reports for decode steps), summed over the prefill, median of 3 runs."""
import random
import statistics
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.engine.step_timers import PARTS

n, count = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(kv_cache_memory="2GiB", threads=2)
engine = llm.engine
engine.wait_for_kv_cache()  # the pool mapped, as bench throughput and the server have it
rng = random.Random(0)
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
runs = []
for run in range(4):
    prompts = [[run + 2] + [rng.randrange(100, 40000) for _ in range(n - 1)] for _ in range(count)]
    with engine.step_timers() as timers:
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"r{run}-{i}", p, one)
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - start
    if run:
        runs.append((wall, dict(timers.seconds)))
wall = statistics.median(w for w, _ in runs)
parts = {p: statistics.median(s[p] for _, s in runs) * 1e3 for p in PARTS}
print(f"{count} prompts x {n} tokens: {wall * 1e3:.0f} ms (median of 3); parts, ms: "
      + ", ".join(f"{p} {v:.1f}" for p, v in parts.items() if v >= 0.5)
      + f"; other {wall * 1e3 - sum(parts.values()):.1f}")
