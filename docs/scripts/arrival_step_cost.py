"""What a prompt adds to a decode step: 63 sequences decoding at ~300 tokens of context, then a step that also runs one
new prompt of N tokens (a server's steady state at 64 clients: a request arrives at nearly every step). Median step
time of 5 per size, speculation off so that every decode step is alike.

    python docs/scripts/arrival_step_cost.py            # the checkout on PYTHONPATH
"""

from __future__ import annotations

import random
import statistics
import time

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

RUNNING, CONTEXT = 63, 300


def main() -> None:
    engine = LLM(None, threads=2, num_speculative_tokens=0).engine
    engine.wait_for_kv_cache(timeout=120)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    for i in range(RUNNING):
        engine.add_request(f"r{i}", prompt(CONTEXT), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    while engine.scheduler.waiting or not all(g.is_decoding for g in engine.scheduler.running):
        engine.step()
    for n in (0, 50, 100, 200, 400, 800):
        times = []
        for rep in range(5):
            engine.step()
            engine.step()
            if n:
                engine.add_request(f"a{n}_{rep}", prompt(n), SamplingParams(temperature=0, max_tokens=1))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        print(f"{RUNNING} decodes + a prompt of {n:3d} tokens: {1000 * statistics.median(times):6.1f} ms a step")


if __name__ == "__main__":
    main()
