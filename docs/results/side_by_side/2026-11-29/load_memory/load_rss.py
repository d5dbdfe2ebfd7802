"""Peak RSS (VmHWM) of an engine's start and one request, and its RSS after: what loading a model costs in memory.
usage: python load_rss.py MODEL [DTYPE]"""
import sys
import time

from pagedllm import LLM, SamplingParams


def status() -> str:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return f"VmRSS {fields['VmRSS'].strip()}, VmHWM {fields['VmHWM'].strip()}"


start = time.perf_counter()
llm = LLM(model=sys.argv[1], threads=2, dtype=sys.argv[2] if len(sys.argv) > 2 else "auto",
          kv_cache_memory="256MiB")
built = time.perf_counter() - start
llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)
print(f"started in {built:.1f} s; after one request: {status()}")
