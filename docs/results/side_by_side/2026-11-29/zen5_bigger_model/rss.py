"""Steady-state RSS (VmRSS) and peak (VmHWM) of an engine after its start (the kernel table read from the cache) and
one request. usage: python rss.py MODEL"""
import sys

from pagedllm import LLM, SamplingParams


def print_rss() -> None:
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            print(line.strip())


llm = LLM(model=sys.argv[1], threads=2)
llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)
print_rss()
