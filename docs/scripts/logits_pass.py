"""The greedy logits pass of the default model, part by part, for a step's sampled rows (bf16, default flags):
quantise the hidden rows, the int8 lm_head GEMM scaled back into bf16 logits (csrc/int8_gemm.cpp; without
AVX512-VNNI torch._int_mm, then dequantize_int32), top-16 + logsumexp (csrc/top_k.cpp), the candidates' fp32
rescoring, and the whole `LlamaModel.top_logits` (which adds the outlier split, Int8Weight.mm); best of 10, ms,
2 threads.

    python docs/scripts/logits_pass.py
"""

from __future__ import annotations

import time

import torch

from pagedllm.entrypoints.llm import LLM


def best_ms(fn, runs: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def parts_ms(model, rows: int) -> list[float]:
    """Each part of the pass for `rows` random hidden rows, then the whole pass."""
    ext, head = model.ext, model.lm_head_weight.int8
    hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows)).bfloat16()
    q, scale = ext.quantize_rows_int8(hidden, ext.int8_gemm_input_max() if head.packed is not None else 127)
    logits = torch.empty(rows, head.out_features, dtype=torch.bfloat16)
    if head.packed is not None:
        def gemm() -> None:
            ext.int8_gemm(q, head.packed, scale, head.scale, None, logits)
    else:
        def gemm() -> None:
            ext.dequantize_int32(torch._int_mm(q, head.q_t), scale, head.scale, None, logits)
    gemm()
    _, ids, _ = ext.top_k_logsumexp(logits, 16)
    return [best_ms(lambda: ext.quantize_rows_int8(hidden)), best_ms(gemm),
            best_ms(lambda: ext.top_k_logsumexp(logits, 16)), best_ms(lambda: model._exact_logits(hidden, ids)),
            best_ms(lambda: model.top_logits(hidden))]


def main() -> None:
    model = LLM(None, threads=2).engine.runner.model
    print(f"{'rows':>5} {'quantise':>9} {'int8 GEMM to bf16':>18} {'top-k+lse':>10} {'rescore':>8} {'all':>8}")
    for rows in (32, 64, 128, 256):
        parts = parts_ms(model, rows)
        print(f"{rows:>5} " + " ".join(f"{p:>{w}.2f}" for p, w in zip(parts, (9, 18, 10, 8, 8), strict=True)))


if __name__ == "__main__":
    main()
