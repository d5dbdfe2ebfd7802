"""A plain request's latency (greedy, 64 tokens) while one request of n=32 samples runs beside it, through the engine;
every condition in the same process, alternating round by round (the machine is shared). Conditions: alone; n=32
unconstrained; n=32 under each regex with the mask filled as before (in the engine's thread, before the forward, no
budget) and as now (the mask thread while the forward runs, the step budget and the start check).

usage: python docs/scripts/grammar_mask_latency.py ROUNDS REGEX...  (docs/structured-outputs.md: 3 "a{5000}" "a{1000}")
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future

import pagedllm.engine.structured_output as so
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

PLAIN = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


class Conditions:
    """The engine, switched between the old mask fill (no bounds) and the new one."""

    def __init__(self) -> None:
        self.engine = LLM().engine
        self.thread_fill = self.engine.structured.start_fill
        self.check = so.check_mask_cost
        self.budget = self.engine.output_processor.mask_budget
        self.results: dict[str, list[float]] = {}

    def inline_fill(self, matchers, costs) -> Future:
        done: Future = Future()
        done.set_result(self.engine.structured.fill_bitmask(matchers, costs))
        return done

    def use_old_fill(self, old: bool) -> None:
        self.engine.structured.start_fill = self.inline_fill if old else self.thread_fill
        so.check_mask_cost = (lambda seconds, n: None) if old else self.check
        self.engine.output_processor.mask_budget = so.MaskBudget(limit_ms=1e9) if old else self.budget

    def run(self, tag: str, heavy: SamplingParams | None) -> None:
        eng, note = self.engine, ""
        if heavy is not None:
            try:
                eng.add_request(tag + "-heavy", "Write the letter a many times:", heavy)
                eng.step()
                eng.step()
            except ValueError as e:
                note = "refused: " + str(e)[:100]
        start = time.perf_counter()
        eng.add_request(tag + "-plain", "Tell me about the ocean.", PLAIN)
        done = 0.0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.request_id == tag + "-plain" and out.finished:
                    done = time.perf_counter() - start
                    eng.abort_request(tag + "-heavy")
            for error in eng.pop_failed_requests().values():
                note = f"failed after {time.perf_counter() - start:.1f} s: {str(error)[:90]}"
        self.results.setdefault(tag.split("#")[0], []).append(done)
        print(f"{tag}: plain {done:.2f} s {note}", flush=True)


def main() -> None:
    rounds, regexes = int(sys.argv[1]), sys.argv[2:]
    c = Conditions()
    c.run("warm", None)
    for r in range(rounds):
        c.run(f"alone#{r}", None)
        c.run(f"free32#{r}", SamplingParams(n=32, temperature=0, max_tokens=200, ignore_eos=True))
        for rx in regexes:
            heavy = SamplingParams(n=32, temperature=0, max_tokens=200,
                                   structured_outputs=StructuredOutputsParams(regex=rx))
            for old in (True, False):
                c.use_old_fill(old)
                c.run(f"{rx} {'before' if old else 'after'}#{r}", heavy)
            c.use_old_fill(False)
    print("medians:")
    for key, values in c.results.items():
        values = sorted(values)
        print(f"  {key}: {values[len(values) // 2]:.2f} s  ({', '.join(f'{x:.2f}' for x in values)})")
    os.system("uptime")


if __name__ == "__main__":
    main()
