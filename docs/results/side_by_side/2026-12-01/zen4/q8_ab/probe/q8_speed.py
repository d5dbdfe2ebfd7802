"""int4_linear_q8 alone against bf16_gemm on bf16 rows (the default model's gate_up and down shapes, 32-1,024 rows),
built from pagedllm/model/csrc/int4_linear_q8.cpp with extra compiler flags, so that variants of the kernel (its
block rows, a part left out under #ifdef while the kernel was tuned) can be timed side by side.
usage: T=THREADS python q8_speed.py NAME [-DFLAG ...]   (from the repository's root)"""
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

root = Path.cwd()
sys.path[:0] = [str(root), str(root / "tests"), str(root / "tests" / "model")]
from test_int4 import random_q4  # noqa: E402

from pagedllm.model import kernels  # noqa: E402
from pagedllm.model.weight_forms import Bf16Weight, Int4Weight  # noqa: E402

csrc = root / "pagedllm" / "model" / "csrc"
variant, flags = sys.argv[1], sys.argv[2:]
ext = load(name=f"q8_{variant}", sources=[str(csrc / "int4_linear_q8.cpp"), str(Path(__file__).with_name("bind.cpp"))],
           extra_cflags=["-O3", "-march=native", "-fopenmp", *flags], extra_ldflags=["-fopenmp"])
main = kernels.load()
torch.set_num_threads(int(os.environ.get("T", "1")))


def best_of_5(f) -> float:
    f()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


for n, k in [(3072, 576), (576, 1536)]:
    q, s, m = random_q4(n, k, False, 1)
    form = Int4Weight.packed_form(q, s, m, torch.float32)
    bw = Bf16Weight(torch.randn(n, k).bfloat16(), main)
    for rows in (32, 128, 512, 1024):
        x = torch.randn(rows, k).bfloat16()
        a, b = best_of_5(lambda: ext.q8(x, *form)), best_of_5(lambda: bw.mm(x))
        print(f"{variant:10s} {n}x{k} rows {rows:4d}: q8 {a * 1e6:7.0f} us ({rows * n * k / a / 1e9:5.0f} G/s)  "
              f"bf16_gemm {b * 1e6:7.0f} us ({rows * n * k / b / 1e9:5.0f} G/s)")
