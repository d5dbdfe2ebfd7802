"""Where a default-model start goes: the import's seconds, then cProfile's cumulative seconds of the engine's build and
one 1-token request (profiler overhead included), the pagedllm functions first."""
import cProfile
import pstats
import time

start = time.time()
from pagedllm import LLM, SamplingParams  # noqa: E402

print(f"import {time.time() - start:.2f} s")
profile = cProfile.Profile()
profile.enable()
LLM().generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
profile.disable()
print(f"to the first token {time.time() - start:.2f} s")
pstats.Stats(profile).sort_stats("cumulative").print_stats(r"pagedllm|mkldnn", 30)
