"""The fp32 4-bit kernel built for CPUs without AVX-512 (`-march=haswell`: AVX2, FMA, F16C; csrc/int4_f32_avx2.h)
gives the same sums, bit for bit, as this machine's build, through both schedules. CI runs on whichever CPU kind it
gets, so the AVX2 code is built and run here too (haswell_build.py)."""

from __future__ import annotations

import pytest
import torch
from haswell_build import build_for_haswell
from test_int4 import f32_kernel, random_q4

from pagedllm.model.layers import Int4Weight


@pytest.fixture(scope="module")
def haswell():
    ext = build_for_haswell()
    assert ext.int4_linear_f32_supported()
    return ext


@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 576), (576, 64), (960, 576), (576, 1536)])
def test_the_avx2_build_gives_this_builds_sums_bit_for_bit(haswell, n, k):
    """Row counts through the narrow schedule (quarters of 4 rows and fewer) and the wide one (blocks of 6 rows over
    16 columns), an odd number of tiles (run partly as halves) too, Q4_0 and Q4_1 scales."""
    ext = f32_kernel()
    g = torch.Generator().manual_seed(n + k)
    for q4_0 in (True, False):
        weight = Int4Weight(*random_q4(n, k, q4_0, n * k), ext, torch.float32)
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 64, 97):
            x = torch.randn(rows, k, generator=g)
            ours = haswell.int4_linear_f32(x, *weight.form)
            assert torch.equal(ours, weight.mm(x)), (n, k, rows, q4_0)
