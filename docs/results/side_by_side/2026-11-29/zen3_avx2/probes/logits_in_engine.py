"""The default engine's lm_head in place: top_logits (what greedy decoding runs: the routed product, then the top
candidates and logsumexp, rescored in fp32 where the lm_head is int8), the int8 form alone (with its outlier
channels), oneDNN's fp32 form alone, and oneDNN's then top_k_logsumexp (the path before the AVX2 int8 kernel).
Best of 20 calls, 2 threads.
    python docs/results/side_by_side/2026-11-29/zen3_avx2/probes/logits_in_engine.py"""

import time
from collections.abc import Callable

import torch

from pagedllm import LLM


def best_ms(fn: Callable[[], object], runs: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    llm = LLM(kv_cache_memory="64MiB", threads=2)
    model = llm.engine.runner.model
    weight = model.lm_head_weight
    print("paths", weight.paths(), "route", weight.route, "exact", model.exact_logits)
    for rows in (1, 5, 16):
        h = torch.randn(rows, 576)
        top = best_ms(lambda h=h: model.top_logits(h))
        int8 = best_ms(lambda h=h: weight.mm(h, path="int8"))
        onednn = best_ms(lambda h=h: weight.mm(h, path="onednn"))
        before = best_ms(lambda h=h: model.ext.top_k_logsumexp(weight.mm(h, path="onednn"), 16))
        print(rows, f"top_logits {top:.2f} ms int8 mm {int8:.2f} onednn mm {onednn:.2f} topk {before:.2f}")


if __name__ == "__main__":
    main()
