"""Build time of the default model's engine (fp32, 256 MiB KV cache), 4 builds in one process, with the engine's heap
trim after its build (on, timed) or without it (off). usage: python trim_cost.py on|off"""
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.model import heap

real = heap.trim
if sys.argv[1] == "off":
    heap.trim = lambda: False
else:
    def timed():
        t = time.perf_counter()
        r = real()
        print(f"  trim {1e3 * (time.perf_counter() - t):.1f} ms")
        return r
    heap.trim = timed
for i in range(4):
    t = time.perf_counter()
    llm = LLM(kv_cache_memory="256MiB", dtype="float32")
    built = time.perf_counter() - t
    llm.generate(["Hello"] * 8, SamplingParams(max_tokens=16), use_tqdm=False)
    print(sys.argv[1], i, f"build {built:.2f} s, build+generate {time.perf_counter() - t:.2f} s")
    del llm
