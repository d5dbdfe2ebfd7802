"""Step time of a batch of one plain request plus n=32 samples under a regex, the mask filled as before (engine
thread, before the forward) and as now (mask thread, during the forward), and of the same batch unconstrained;
alternating in one process, the budget lifted so that nothing is failed.

usage: python docs/scripts/grammar_mask_steps.py ROUNDS STEPS REGEX  (docs/structured-outputs.md: 5 30 "a{1000}")
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import Future

import pagedllm.engine.structured_output as so
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def main() -> None:
    rounds, steps, rx = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    eng = LLM().engine
    thread_fill = eng.structured.start_fill

    def inline_fill(matchers, costs) -> Future:
        done: Future = Future()
        done.set_result(eng.structured.fill_bitmask(matchers, costs))
        return done

    eng.output_processor.mask_budget = so.MaskBudget(limit_ms=1e9)
    results: dict[str, list[float]] = {}

    def run(tag: str, params: SamplingParams) -> None:
        eng.add_request(tag + "-p", "Tell me about the ocean.",
                        SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        eng.add_request(tag + "-h", "Write the letter a many times:", params)
        for _ in range(3):
            eng.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - start)
        eng.abort_request(tag + "-p")
        eng.abort_request(tag + "-h")
        median = statistics.median(times) * 1e3
        results.setdefault(tag.split("#")[0], []).append(median)
        print(f"{tag}: median step {median:.1f} ms", flush=True)

    grammar = SamplingParams(n=32, temperature=0, max_tokens=400, structured_outputs=StructuredOutputsParams(regex=rx))
    free = SamplingParams(n=32, temperature=0, max_tokens=400, ignore_eos=True)
    run("warm", free)
    for r in range(rounds):
        eng.structured.start_fill = inline_fill
        run(f"before#{r}", grammar)
        eng.structured.start_fill = thread_fill
        run(f"after#{r}", grammar)
        run(f"free#{r}", free)
    for key, values in results.items():
        print(f"{key}: median of medians {statistics.median(values):.1f} ms ({', '.join(f'{x:.1f}' for x in values)})")
    os.system("uptime; lscpu | grep 'Model name'")


if __name__ == "__main__":
    main()
