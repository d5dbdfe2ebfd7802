"""LlamaModel.top_logits (the greedy logits pass) of the default model by row count: ms (best of 10) and minor page
faults per call, 2 threads. Run with the commit before and after the kept logits buffer (PYTHONPATH=TREE).

    python top_logits_faults.py
"""

from __future__ import annotations

import resource
import time

import torch

from pagedllm.entrypoints.llm import LLM


def main() -> None:
    model = LLM(None, threads=2).engine.runner.model
    for rows in (64, 128, 200, 256):
        hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows)) * 2
        model.top_logits(hidden)
        faults, best = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, float("inf")
        for _ in range(10):
            start = time.perf_counter()
            model.top_logits(hidden)
            best = min(best, time.perf_counter() - start)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 10
        print(f"{rows:>4} rows: {best * 1e3:7.2f} ms, {faults:7.0f} page faults a call")


if __name__ == "__main__":
    main()
