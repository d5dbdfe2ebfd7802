"""RSS of an engine after its first request, after returning the C heap's free pages (malloc_trim), and after
another request: what the heap kept of the build's freed memory (the engine's own trim after its build turned off
here). usage: python trim_gain.py [MODEL]"""
import ctypes
import sys

from pagedllm import LLM, SamplingParams
from pagedllm.model import heap

heap.trim = lambda: False  # as before the engine trimmed its heap after the build


def rss() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) // 1024


llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None, threads=2, kv_cache_memory="256MiB")
llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)
print("after one request", rss(), "MB")
ctypes.CDLL(None).malloc_trim(0)
print("after malloc_trim", rss(), "MB")
llm.generate("Hello again", SamplingParams(max_tokens=8), use_tqdm=False)
print("after another request", rss(), "MB")
