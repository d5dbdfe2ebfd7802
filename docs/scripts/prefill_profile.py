"""A prefill step of 1,024 tokens (4 prompts of 256) of the default model: its time, and the time and GFLOP/s of its
layer matmuls, from torch's profiler (the packed bf16 matmul is `mkldnn::_linear_pointwise`):
    python docs/scripts/prefill_profile.py
"""

import random
import time

from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm.bench.roofline import layer_params

llm = LLM(kv_cache_memory="1GiB")
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(4)]
one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate([[1] * 300], one_token, use_tqdm=False)  # warm-up


def prefill(tag: int) -> float:
    """The 4 prompts, each behind a new first token so that nothing comes from the prefix cache."""
    start = time.perf_counter()
    llm.generate([[tag] + p for p in prompts], one_token, use_tqdm=False)
    return time.perf_counter() - start


step_s = sorted(prefill(i) for i in range(5))[2]
with profile(activities=[ProfilerActivity.CPU]) as prof:
    prefill(99)
linear = next(e for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")
# 1,028 tokens: a 1,024-token step on the bf16 matmul, then a 4-token step (on the int4 kernel, not counted here)
linear_s = linear.self_cpu_time_total / 1e6
gflops = 2 * layer_params(llm.engine.model_config) * 1024 / linear_s / 1e9
print(f"prefill of 1,028 tokens: {step_s * 1e3:.0f} ms (median of 5); bf16 layer matmuls {linear_s * 1e3:.0f} ms "
      f"({linear.count} calls, {gflops:.0f} GFLOP/s on 1,024 rows)")
