"""oneDNN's int8 matmul (torch._int_mm) with and without VNNI: random int8 [32, 576] x [576, 64], the largest error
against the exact int64 product. Without VNNI (here: oneDNN capped at AVX2) it pairs u8 x s8 products into int16
with saturation (vpmaddubsw), so the engine runs no int8 on such CPUs (kernels.int8_products_exact).

    python docs/scripts/int8_products_avx2.py native
    python docs/scripts/int8_products_avx2.py avx2
"""

from __future__ import annotations

import os
import sys

if sys.argv[1:] == ["avx2"]:
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # read when torch loads
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"

import torch  # noqa: E402


def main() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 576), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (576, 64), generator=g, dtype=torch.int8)
    exact = a.long() @ b.long()
    err = (torch._int_mm(a, b).long() - exact).abs().max().item()
    print(f"{sys.argv[1:] or ['native']}: largest error {err} against products up to {exact.abs().max().item()}")


if __name__ == "__main__":
    main()
