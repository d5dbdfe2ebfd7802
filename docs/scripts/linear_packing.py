"""The default model's matmuls with plain weights (F.linear) vs weights packed once for oneDNN (layers.PackedWeight),
median ms, the two interleaved so background load hits both alike:
    python docs/scripts/linear_packing.py
"""


import torch
import torch.nn.functional as F

from pagedllm.bench.roofline import call_times
from pagedllm.model.layers import PackedWeight, linear

torch.set_num_threads(2)
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]
LM_HEAD = (49152, 576)


def median_ms(fn, repeats: int = 30) -> float:
    return sorted(call_times(fn, repeats, warmup=3))[repeats // 2] * 1e3


print("| dtype | rows M | layer plain | layer packed | speed-up | lm_head plain | lm_head packed | speed-up |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for dtype in (torch.bfloat16, torch.float32):
    for m in (1, 32, 128, 1024):
        row = []
        for shapes in (LAYER, [LM_HEAD]):
            plain = packed = 0.0
            for out_features, in_features in shapes:
                x = torch.randn(m, in_features).to(dtype)
                w = torch.randn(out_features, in_features).to(dtype)
                pw = PackedWeight(w)
                torch.testing.assert_close(linear(x, pw).float(), F.linear(x, w).float(), rtol=2e-2, atol=1e-1)
                plain += median_ms(lambda x=x, w=w: F.linear(x, w))
                packed += median_ms(lambda x=x, pw=pw: linear(x, pw))
            row += [f"{plain:.2f}", f"{packed:.2f}", f"{plain / packed:.2f}x"]
        print(f"| {str(dtype)[6:]} | {m} | " + " | ".join(row) + " |")
