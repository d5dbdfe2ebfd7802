"""The int8 lm_head's GEMM (torch._int_mm, oneDNN's VNNI kernel) over the default model's 49,152 x 576 shape: one
call over all columns against calls over blocks of 4,096 or 8,192 columns (Int8Weight runs blocks of
weight_forms.INT8_COLUMN_BLOCK), best of 8, 2 threads.

    python docs/scripts/int8_column_blocks.py
"""

from __future__ import annotations

import time

import torch

VOCAB, HIDDEN = 49152, 576


def best_ms(fn, runs: int = 8) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def times_ms(x: torch.Tensor, w_t: torch.Tensor) -> tuple[float, float, float]:
    """One call, 4096-column blocks, 8192-column blocks."""
    blocks = [best_ms(lambda b=b: [torch._int_mm(x, w_t[:, j:j + b]) for j in range(0, VOCAB, b)])
              for b in (4096, 8192)]
    return best_ms(lambda: torch._int_mm(x, w_t)), blocks[0], blocks[1]


def main() -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    w_t = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8, generator=gen).t()
    print(f"{'rows':>5} {'one call ms':>12} {'GOPS':>6} {'4096-col blocks':>16} {'GOPS':>6} {'8192-col blocks':>16}")
    for rows in (32, 64, 128, 160, 192, 256):
        one, b4096, b8192 = times_ms(torch.randint(-127, 128, (rows, HIDDEN), dtype=torch.int8, generator=gen), w_t)
        ops = 2 * rows * HIDDEN * VOCAB / 1e6
        print(f"{rows:>5} {one:>12.2f} {ops / one:>6.0f} {b4096:>16.2f} {ops / b4096:>6.0f} {b8192:>16.2f}")


if __name__ == "__main__":
    main()
