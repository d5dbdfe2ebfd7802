"""The lm_head's int8 product with its 16 outlier channels (Int8Weight.mm, as the default model runs it), by both
paths: the int8_gemm kernel (AVX512-VNNI) and torch._int_mm + dequantize_int32 (the dispatch's `int8_mm`, oneDNN's
int8 matmul: AMX tiles where the CPU has them). Random bf16 weights of the lm_head's shape, best of 15, ms, 2 threads:
    python docs/scripts/int8_lm_head_paths.py
"""

import torch
from logits_pass import best_ms  # this folder

from pagedllm.model import kernels
from pagedllm.model.layers import Int8Weight

ext = kernels.load()
torch.set_num_threads(2)
weight = Int8Weight(torch.randn(49152, 576, generator=torch.Generator().manual_seed(0)).bfloat16(), ext,
                    outliers=16, int_mm=True)

for rows in (64, 256):
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    x[:, [5, 77]] *= 20  # a few channels far above the rest, as in the model's hidden state
    kernel = best_ms(lambda x=x: weight.mm(x, kernel=True), 15) if weight.packed is not None else float("nan")
    int_mm = best_ms(lambda x=x: weight.mm(x, kernel=False), 15)
    print(f"{rows:4d} rows: int8_gemm {kernel:.2f} ms, torch._int_mm path {int_mm:.2f} ms")
