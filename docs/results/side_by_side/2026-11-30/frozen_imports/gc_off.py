"""A start with the cyclic GC off during the import and LLM() (MODE=off), or also frozen after (MODE=freeze), or as
is (MODE=on): seconds, and the collections after (a 200-token generate)."""
import gc
import os
import time

mode = os.environ.get("MODE", "on")
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
if mode != "on":
    gc.disable()
from pagedllm import LLM, SamplingParams  # noqa: E402

t1 = time.perf_counter()
llm = LLM()
if mode == "freeze":
    gc.freeze()
gc.enable()
t2 = time.perf_counter()
llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
before = {g: tuple(v) for g, v in spent.items()}
llm.generate(["Hi"] * 8, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
t4 = time.perf_counter()
print(f"{mode}: import {t1 - t0:.2f} LLM() {t2 - t1:.2f} first token {t3 - t0:.2f}; gc to it:",
      ", ".join(f"gen{g} {n} x {s:.3f}" for g, (n, s) in before.items()), "; in 8x200 tokens",
      f"({t4 - t3:.2f} s):", ", ".join(f"gen{g} {spent[g][0] - n} x {spent[g][1] - s:.3f}"
                                     for g, (n, s) in before.items()))
