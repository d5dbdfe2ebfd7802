"""Where the prefill of 4 prompts of N random tokens goes (the engine's step timers, each part in ms), three rounds,
each of new prompts so that nothing comes from the prefix cache. usage: python prefill_parts.py [N]"""
import sys
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.step_timers import PARTS


def main(n: int) -> None:
    eng = LLM(kv_cache_memory="2GiB").engine
    eng.wait_for_kv_cache()
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    for rnd in range(3):
        for i in range(4):
            eng.add_request(f"r{rnd}-{i}", torch.randint(100, 40000, (n,), generator=gen).tolist(), params)
        with eng.step_timers() as timers:
            start, steps = time.perf_counter(), 0
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
            wall = time.perf_counter() - start
        parts = {k: round(timers.seconds[k] * 1e3, 1) for k in PARTS}
        print(f"round {rnd}: wall {wall * 1e3:.0f} ms, {steps} steps, other {wall * 1e3 - sum(parts.values()):.0f}",
              parts)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1900)
