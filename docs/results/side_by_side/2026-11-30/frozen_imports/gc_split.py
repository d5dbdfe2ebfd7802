"""Seconds the cyclic garbage collector takes during a start (the import, then LLM() and the first token), by
generation, with the number of objects it tracks at the end."""
import gc
import time

spent = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
started = {}


def watch(phase, info):
    if phase == "start":
        started["t"] = time.perf_counter()
    else:
        s = spent[info["generation"]]
        s[0] += 1
        s[1] += time.perf_counter() - started["t"]


gc.callbacks.append(watch)
t0 = time.perf_counter()
from pagedllm import LLM, SamplingParams  # noqa: E402

t1 = time.perf_counter()
at_import = {g: tuple(v) for g, v in spent.items()}
llm = LLM()
t2 = time.perf_counter()
llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
print(f"import {t1 - t0:.2f} LLM() {t2 - t1:.2f} first token {t3 - t0:.2f}; gc:",
      ", ".join(f"gen{g} {n} x {s:.3f} s" for g, (n, s) in spent.items()), f"objects {len(gc.get_objects())}")
print("at the import's end:", ", ".join(f"gen{g} {n} x {s:.3f} s" for g, (n, s) in at_import.items()))
