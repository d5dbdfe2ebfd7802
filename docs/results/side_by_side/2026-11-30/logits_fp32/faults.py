"""Why the int8 lm_head's call (Int8Weight.mm: the outlier split, then int8_gemm into a fresh output) took up to 1.5x
the GEMM alone at 200-256 rows: page faults of the fresh [rows, 49,152] fp32 output, which past glibc's 32 MiB mmap
threshold is mapped afresh at every call. Per row count: minor page faults per call and ms (best of 10) for the GEMM
with the outlier product into a kept output, and for Int8Weight.mm; 2 threads.

    python faults.py
"""

from __future__ import annotations

import resource
import time

import torch

from pagedllm.entrypoints.llm import LLM


def best_ms_faults(fn, runs: int = 10) -> tuple[float, float]:
    fn()
    best, f0 = float("inf"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / runs


def main() -> None:
    model = LLM(None, threads=2).engine.runner.model
    print(f"{'rows':>5} {'MiB out':>8} {'kept out: ms':>13} {'faults':>7} {'mm: ms':>8} {'faults':>7}")
    for rows in (64, 128, 160, 200, 256):
        print(row_figures(model, rows))


def row_figures(model, rows: int) -> str:
    ext, head = model.ext, model.lm_head_weight.int8
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows)) * 2
    channels = x.abs().amax(dim=0).topk(head.outliers).indices
    big, w = x.index_select(1, channels).float(), head.plain_t.index_select(0, channels)
    q, scale = ext.quantize_rows_int8(x.index_fill(1, channels, 0), ext.int8_gemm_input_max())
    out = torch.empty(rows, head.out_features)
    kept = best_ms_faults(lambda: ext.int8_gemm(q, head.packed, scale, head.scale, None, out, big, w))
    fresh = best_ms_faults(lambda: head.mm(x))
    return (f"{rows:>5} {out.numel() * 4 / 2 ** 20:>8.1f} {kept[0]:>13.2f} {kept[1]:>7.0f} {fresh[0]:>8.2f} "
            f"{fresh[1]:>7.0f}")

if __name__ == "__main__":
    main()
