"""The lm_head's matmul at the default model's shape (hidden 576 -> vocab 49,152; bf16 rows in, bf16 logits out),
per number of rows M, four ways:

- int8 + 16 split: what the default path runs now, the kernel below with the 16 largest input channels of each call
  through the plain weight (Int8Weight's `outliers`, llama.LM_HEAD_OUTLIER_CHANNELS);
- int8 kernel: Int8Weight.mm without the split, quantize_rows_int8 + int8_gemm (csrc/int8_gemm.cpp, weight packed at
  load);
- int8 _int_mm: the path before it (and the fallback without AVX512-VNNI), quantize_rows_int8 + torch._int_mm per
  4,096 output columns + dequantize_int32;
- bf16: oneDNN's matmul on the weight packed once (PackedWeight), what runs without int8.

ms per call (best of several calls, the four interleaved in rounds so machine noise hits them alike) and GOP/s
(2 * M * 576 * 49,152 operations). Random weights: the time does not depend on their values. Before each timed
call a 64 MB buffer is written, which evicts the weights from the L3 cache (32 MB here, the int8 weight is 28 MB) as
a forward pass over the rest of the model does in the engine; --warm skips that (the weight then stays in L3 and
small M runs faster than memory allows). 2 threads.

    python docs/scripts/lm_head_int8.py [--warm] [--rows 1 4 16 64 193 512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Int8Weight
from pagedllm.model.llama import LM_HEAD_OUTLIER_CHANNELS

VOCAB, HIDDEN = 49152, 576


def best_ms(fn: Callable[[], object], runs: int, evict: torch.Tensor | None) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        if evict is not None:
            evict.add_(1)
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", action="store_true", help="leave the weights in the caches between calls")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 193, 512])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    ext = kernels.load()
    if ext is None:
        raise SystemExit(f"the C++ kernels did not build: {kernels.build_error()}")
    if not ext.int8_gemm_supported():
        raise SystemExit("int8_gemm needs AVX512-VNNI, which this CPU lacks")
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN ** 0.5).bfloat16()
    paths = {"int8 + 16 split": Int8Weight(weight, ext, outliers=LM_HEAD_OUTLIER_CHANNELS).mm,
             "int8 kernel": Int8Weight(weight, ext).mm, "int8 _int_mm": Int8Weight(weight, ext, kernel=False).mm}
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    paths["bf16 oneDNN"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    evict = None if args.warm else torch.zeros(64 << 20, dtype=torch.uint8)
    print(f"{'rows':>5}" + "".join(f" {name + ' ms':>16} {'GOP/s':>6}" for name in paths))
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
        runs = 20 if rows <= 64 else 5
        times = dict.fromkeys(paths, float("inf"))
        for _ in range(args.rounds):
            for name, mm in paths.items():
                times[name] = min(times[name], best_ms(lambda mm=mm, x=x: mm(x), runs, evict))
        gops = 2 * rows * HIDDEN * VOCAB / 1e6
        print(f"{rows:>5}" + "".join(f" {t:>16.2f} {gops / t:>6.0f}" for t in times.values()), flush=True)


if __name__ == "__main__":
    main()
