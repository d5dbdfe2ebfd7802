"""Where the ShareGPT-like workload's time goes: the 200 requests of `pagedllm bench throughput --dataset sharegpt
--num-prompts 200 --seed 0` (greedy, ignore_eos, exact output lengths), all queued at once, with the engine's step
timers on (`LLMEngine.step_timers`, as `pagedllm bench latency` uses them), seconds per part of every step.

    python docs/scripts/workload_parts.py [EXTRA ENGINE KWARGS AS key=value ...]   e.g. kv_cache_dtype=int8

The timers add a little Python per call, so the total runs a few percent slower than the benchmark itself.
"""

from __future__ import annotations

import sys
import time

from pagedllm.bench.datasets import sample_requests
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    kwargs = {k: int(v) if v.isdigit() else v for k, v in (arg.split("=", 1) for arg in sys.argv[1:])}
    llm = LLM(None, threads=2, **kwargs)
    requests = sample_requests("sharegpt", llm.get_tokenizer(), 200, 0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    llm.engine.wait_for_kv_cache(timeout=120)  # as bench throughput does: the pool mapped before the clock starts
    start = time.perf_counter()
    with llm.engine.step_timers() as timers:
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(r.output_len for r in requests)
    print(f"{wall:.1f} s, {tokens / wall:.1f} output tokens/s with the timers on")
    for part, seconds in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
        print(f"{part:<14} {seconds:6.2f} s {100 * seconds / wall:5.1f}%  ({timers.calls[part]} calls)")


if __name__ == "__main__":
    main()
