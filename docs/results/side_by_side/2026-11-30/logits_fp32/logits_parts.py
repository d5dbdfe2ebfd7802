"""The greedy logits pass of the default model where `--dtype auto` runs fp32 (no bf16 arithmetic), part by part, for
a step's sampled rows: the outlier split and quantisation, the int8 lm_head GEMM into fp32 logits, top-16 +
logsumexp (csrc/fused_ops.cpp), the candidates' fp32 rescoring, and the whole `LlamaModel.top_logits`; best of 10,
ms, 2 threads.

    python logits_parts.py
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
    """Each part of the pass for `rows` random hidden rows (scaled like the model's), then the whole pass."""
    ext, head = model.ext, model.lm_head_weight.int8
    hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows)) * 2
    qmax = ext.int8_gemm_input_max()
    logits = torch.empty(rows, head.out_features)
    head.mm(hidden)
    _, ids, _ = ext.top_k_logsumexp(head.mm(hidden), 16)
    q, scale = ext.quantize_rows_int8(hidden, qmax)
    return [best_ms(lambda: ext.quantize_rows_int8(hidden, qmax)),
            best_ms(lambda: ext.int8_gemm(q, head.packed, scale, head.scale, None, logits, None, None)),
            best_ms(lambda: head.mm(hidden)), best_ms(lambda: ext.top_k_logsumexp(logits, 16)),
            best_ms(lambda: model._exact_logits(hidden, ids)), best_ms(lambda: model.top_logits(hidden))]


def main() -> None:
    model = LLM(None, threads=2).engine.runner.model
    print(f"dtype {model.dtype}, int8 input range +-{model.ext.int8_gemm_input_max()}")
    names = ("quantise", "int8 GEMM", "lm_head mm", "top-k+lse", "rescore", "top_logits")
    print(f"{'rows':>5} " + " ".join(f"{n:>10}" for n in names))
    for rows in (64, 128, 200, 256):
        print(f"{rows:>5} " + " ".join(f"{p:>10.2f}" for p in parts_ms(model, rows)))


if __name__ == "__main__":
    main()
