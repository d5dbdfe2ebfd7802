"""The default model's 120 layer matmuls (30 layers x qkv, o, gate_up, down, each its own random weights, so they come
from memory as in a real step) at M rows: packed bf16 (oneDNN), pagedllm's bf16 kernel (Bf16Weight), torch's int4
kernel, and pagedllm's int4 kernel. Best of 9 ms per pass over all 120, the four interleaved:
    python docs/scripts/int4_kernels.py 1 2 4 8 12 16 24 32 64
"""

import sys
import time

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Bf16Weight, Int4Weight, PackedWeight, linear

torch.set_num_threads(2)
torch.manual_seed(0)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]
ext = kernels.load()


def layer(rows: int, cols: int) -> dict:
    q = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    scale = (torch.rand(rows, cols // 32) * 0.01).half().float()
    min_ = (-torch.rand(rows, cols // 32) * 0.08).half().float()
    torch_sz = torch.stack([scale, min_ + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()  # its (q - 8) form
    torch_q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    ours = Int4Weight(q, scale, min_, ext)
    plain = (q.float().view(rows, cols // 32, 32) * scale[..., None] + min_[..., None]).view(rows, cols).bfloat16()
    packed, own = PackedWeight(plain), Bf16Weight(plain, ext)  # oneDNN (no bf16 form given), pagedllm's bf16_gemm
    return {"bf16": lambda x: linear(x, packed), "pagedllm bf16": own.mm,
            "torch int4": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_q, 32, torch_sz),
            "pagedllm int4": ours.mm}


weights = [[layer(*shape) for shape in SHAPES] for _ in range(30)]
modes = ("bf16", "pagedllm bf16", "torch int4", "pagedllm int4")
print("| rows M | " + " | ".join(f"{m} ms" for m in modes) + " | oneDNN / pagedllm bf16 | torch / pagedllm int4 |")
print("|---:|" + "---:|" * (len(modes) + 2))
for m in map(int, sys.argv[1:]):
    xs = {cols: torch.randn(m, cols).bfloat16() for cols in (576, 1536)}
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(9):
        for mode in modes:
            start = time.perf_counter()
            for block in weights:
                for fns, (_, cols) in zip(block, SHAPES):
                    fns[mode](xs[cols])
            best[mode] = min(best[mode], time.perf_counter() - start)
    cells = " | ".join(f"{best[mode] * 1e3:.1f}" for mode in modes)
    ratios = f"{best['bf16'] / best['pagedllm bf16']:.2f} | {best['torch int4'] / best['pagedllm int4']:.2f}"
    print(f"| {m} | {cells} | {ratios} |")
