"""Two costs around a grammar mask, as docs/structured-outputs.md reports them.

1. logsumexp of 32 rows of the 49k vocabulary, plain and grammar-masked: torch's against the sampler's `_logsumexp`.
2. What filling a 32-row mask before every step does to the model's forward pass: the unconstrained batch of
   `pagedllm bench structured`, each step preceded by nothing, a 1.7 ms sleep, llguidance's per-matcher fill from the
   engine's thread, or llguidance's parallel executor (last: its threads outlive it); involuntary context switches
   (getrusage) and forward-pass seconds per run.

usage: python docs/scripts/mask_costs.py [--runs 2]
"""

from __future__ import annotations

import argparse
import resource
import time

import llguidance as llg
import torch

from pagedllm.bench import structured as bench
from pagedllm.entrypoints.llm import LLM
from pagedllm.model.sampler import _logsumexp
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def per_call_ms(fn, calls: int = 200) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def logsumexp_costs(threads: int) -> None:
    torch.set_num_threads(threads)
    plain = torch.randn(32, 49152) * 3
    masked = plain.clone()
    masked[:, 100:] = float("-inf")
    for name, x in (("plain", plain), ("masked", masked)):
        print(f"logsumexp, {name} rows: torch {per_call_ms(lambda x=x: x.logsumexp(-1)):.2f} ms, "
              f"_logsumexp {per_call_ms(lambda x=x: _logsumexp(x)):.2f} ms")


def fill_interference(runs: int) -> None:
    llm = LLM()
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    batch = bench.prompts(tokenizer, 32)
    spec = StructuredOutputsParams(json=bench.SCHEMA)
    outs = llm.generate(batch, [SamplingParams(temperature=0, max_tokens=256, structured_outputs=spec)] * 32,
                        use_tqdm=False)
    free = [SamplingParams(temperature=0, max_tokens=len(o.outputs[0].token_ids), ignore_eos=True) for o in outs]
    matchers = engine.structured.new_matchers(spec, 32)
    for m in matchers:  # inside a string: the mask allows most of the vocabulary, the costly case
        assert m.consume_tokens(tokenizer.encode('{"name": "Ada', add_special_tokens=False))
    words = engine.structured.bitmask_words
    executor = None

    def use_executor() -> None:
        nonlocal executor
        executor = executor or llg.LLExecutor(num_threads=1)
        mask = torch.empty((32, words), dtype=torch.int32)
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), words * 4, 32)

    before_step = {"nothing": lambda: None, "sleep 1.7 ms": lambda: time.sleep(0.0017),
                   "per-matcher fill": lambda: engine.structured.fill_bitmask(matchers), "executor": use_executor}
    execute, forward = engine.runner.execute, engine.runner.model.forward
    seconds = [0.0]

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        seconds[0] += time.perf_counter() - start
        return out

    engine.runner.model.forward = timed_forward
    for name, work in before_step.items():
        engine.runner.execute = lambda *a, work=work, **k: (work(), execute(*a, **k))[1]
        for _ in range(runs):
            seconds[0] = 0.0
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            llm.generate(batch, free, use_tqdm=False)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            print(f"{name:>16}: {time.perf_counter() - start:.2f} s, forward {seconds[0]:.2f} s, "
                  f"involuntary switches {r1.ru_nivcsw - r0.ru_nivcsw}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    logsumexp_costs(threads=2)
    fill_interference(args.runs)


if __name__ == "__main__":
    main()
