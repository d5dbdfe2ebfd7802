"""The int8 lm_head GEMM of the default model alone by row count, without and with the 16 outlier channels' fp32
product in its epilogue (`extra_x` / `extra_w`), and the outlier split's torch ops; best of 10, ms, 2 threads.

    python gemm_rows.py
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


def main() -> None:
    model = LLM(None, threads=2).engine.runner.model
    print(f"{'rows':>5} {'GEMM':>8} {'+outliers':>10} {'split':>8}")
    for rows in (64, 128, 160, 192, 200, 224, 256):
        print(row_figures(model, rows))


def row_figures(model, rows: int) -> str:
    ext, head = model.ext, model.lm_head_weight.int8
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows)) * 2
    q, scale = ext.quantize_rows_int8(x, ext.int8_gemm_input_max())
    out = torch.empty(rows, head.out_features)
    channels = x.abs().amax(dim=0).topk(head.outliers).indices
    big, w = x.index_select(1, channels).float(), head.plain_t.index_select(0, channels)

    def split() -> None:
        ch = x.abs().amax(dim=0).topk(head.outliers).indices
        x.index_select(1, ch).float(), x.index_fill(1, ch, 0), head.plain_t.index_select(0, ch)

    plain = best_ms(lambda: ext.int8_gemm(q, head.packed, scale, head.scale, None, out, None, None))
    extra = best_ms(lambda: ext.int8_gemm(q, head.packed, scale, head.scale, None, out, big, w))
    return f"{rows:>5} {plain:>8.2f} {extra:>10.2f} {best_ms(split):>8.2f}"

if __name__ == "__main__":
    main()
