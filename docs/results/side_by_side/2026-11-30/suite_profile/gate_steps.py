"""The accuracy gate's first_steps for one variant (fp32, or bf16 without quantization), profiled: the first call,
then again (from the prefix cache). usage: python gate_steps.py fp32|bf16"""
import cProfile
import pstats
import sys
import time

from pagedllm.bench.accuracy import first_steps, held_out_prompts
from pagedllm.entrypoints.llm import LLM

kwargs = dict(dtype="float32") if sys.argv[1] == "fp32" else dict(dtype="bfloat16", quantization="none")
llm = LLM(None, kv_cache_memory="256MiB", **kwargs)
prompts = held_out_prompts(llm.get_tokenizer(), 24, 1234)
print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens")
for what in ("first", "again"):
    profile = cProfile.Profile()
    profile.enable()
    start = time.perf_counter()
    first_steps(llm, prompts)
    seconds = time.perf_counter() - start
    profile.disable()
    print(f"{what}: {seconds:.2f} s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
