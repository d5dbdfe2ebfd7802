"""The lm_head's product at the default model's shape (576 -> 49,152) per number of rows, fp32 rows in and out: the
int8 kernel (int8_gemm, csrc/int8_gemm_avx2.h on a CPU without VNNI; the rows quantised before, to the kernel's input
range where the tree has one) against oneDNN's fp32 matmul on the packed weight (PackedWeight.onednn_mm). Best of 5
calls, warm, 2 threads. Run with PYTHONPATH set to the tree under test (a worktree of the commit before, or this one).
    python lm_head_probe.py [ROWS ...]"""

import sys
import time
from collections.abc import Callable

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Int8Weight, PackedWeight

VOCAB, HIDDEN = 49152, 576


def best_ms(fn: Callable[[], object], runs: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(rows_list: list[int]) -> None:
    torch.set_num_threads(2)
    ext = kernels.load()
    limit = ext.int8_gemm_input_max() if hasattr(ext, "int8_gemm_input_max") else 127
    print(f"# activations quantised within +-{limit}")
    w = torch.randn(VOCAB, HIDDEN)
    int8, packed = Int8Weight(w, ext), PackedWeight(w)
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN)
        q, scale = ext.quantize_rows_int8(x, limit) if limit != 127 else ext.quantize_rows_int8(x)
        out = torch.empty(rows, VOCAB)
        t_int8 = best_ms(lambda q=q, scale=scale, out=out: ext.int8_gemm(q, int8.packed, scale, int8.scale, None, out))
        t_fp32 = best_ms(lambda x=x: packed.onednn_mm(x, None))
        gop = 2 * rows * VOCAB * HIDDEN / 1e9
        print(f"{rows:5d} int8 {t_int8:8.2f} ms {gop / t_int8 * 1e3:6.1f} GOP/s   "
              f"oneDNN fp32 {t_fp32:8.2f} ms {gop / t_fp32 * 1e3:6.1f}")


if __name__ == "__main__":
    main([int(r) for r in sys.argv[1:]] or [1, 4, 16, 64, 128, 256])
