"""A fresh process's first engine (the default model, fp32, 256 MiB KV cache) with the heap trim after its build (on) or
without (off): its build time and 8 x 32 tokens after. usage: python trim_first.py on|off"""
import sys
import time

t0 = time.perf_counter()
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.model import heap  # noqa: E402

if sys.argv[1] == "off":
    heap.trim = lambda: False
t = time.perf_counter()
llm = LLM(kv_cache_memory="256MiB", dtype="float32")
built = time.perf_counter() - t
t = time.perf_counter()
llm.generate(["Hello"] * 8, SamplingParams(max_tokens=32), use_tqdm=False)
print(sys.argv[1], f"build {built:.2f} s, then 8 x 32 tokens {time.perf_counter() - t:.2f} s")
