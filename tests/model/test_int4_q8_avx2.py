"""The int8-activation 4-bit kernel built for CPUs without AVX512-VNNI (`-march=haswell`: AVX2, FMA, F16C;
csrc/int4_q8_avx2.h, vpmaddubsw) gives the product of the weights with the rows on their int8 grid, and where this
CPU's build has the AVX512-VNNI kernel, its output bits. CI runs on whichever CPU kind it gets, so the AVX2 code is
built and run here too (haswell_build.py)."""

from __future__ import annotations

import pytest
import torch
from haswell_build import build_for_haswell
from test_int4 import random_q4
from test_int4_f16 import dequantized, relative_error
from test_int4_q8 import fake_quantised

from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight


@pytest.fixture(scope="module")
def haswell():
    ext = build_for_haswell()
    assert ext.int4_linear_q8_supported()
    return ext


def special_rows(k: int, g: torch.Generator) -> torch.Tensor:
    """Rows of zeros, with inf, with NaN, and of tiny values down to fp32's subnormals."""
    x = torch.randn(5, k, generator=g)
    x[0] = 0
    x[1, 5] = float("inf")
    x[2, k - 1] = float("nan")
    x[3] *= 1e-40
    x[4] *= 1e-25
    return x


@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 576), (128, 160), (576, 1536)])
def test_the_avx2_build_gives_the_int8_grids_product_and_the_vnni_builds_bits(haswell, n, k):
    """Blocks of 3 rows and their remainders over 16 columns at a time, an odd number of tiles (run partly as
    halves), calls of one row (the nibbles read in place), Q4_0 and Q4_1 scales, bf16 rows as the fp32 rows' output
    rounded to bf16."""
    ext = kernels.load()
    # a second build to compare with: on a CPU without AVX-512 the haswell build is this machine's own
    native = ext is not None and ext is not haswell and ext.int4_linear_q8_supported()
    g = torch.Generator().manual_seed(n + k)
    for q4_0 in (True, False):
        q, scale, min_ = random_q4(n, k, q4_0, n * k)
        w = dequantized(q, scale, min_)
        layout = Int4Weight.packed_form(q, scale, min_, torch.float32)
        for rows in (1, 2, 3, 4, 5, 7, 13, 64, 131):
            x = torch.randn(rows, k, generator=g)
            x[:, 3] *= 40  # an outlier channel, as the hidden state has
            out = haswell.int4_linear_q8(x, *layout)
            grid, kept = fake_quantised(x)
            assert relative_error(out, (grid.double() + kept.double()) @ w.T) < 1e-5, (n, k, rows, q4_0)
            if native:
                assert torch.equal(out, ext.int4_linear_q8(x, *layout)), (n, k, rows, q4_0)
            assert torch.equal(haswell.int4_linear_q8(x.bfloat16(), *layout),
                               haswell.int4_linear_q8(x.bfloat16().float(), *layout).bfloat16())
        odd = special_rows(k, g)
        out = haswell.int4_linear_q8(odd, *layout)
        assert torch.equal(out[0], torch.zeros(n)) and out[1].isnan().all() and out[2].isnan().all()
        assert torch.isfinite(out[3:]).all()
        for r in range(len(odd)):  # a call of one row reads the nibbles in place: the batch's bits
            torch.testing.assert_close(haswell.int4_linear_q8(odd[r:r + 1].clone(), *layout), out[r:r + 1], rtol=0,
                                       atol=0, equal_nan=True)
        if native:
            torch.testing.assert_close(out, ext.int4_linear_q8(odd, *layout), rtol=0, atol=0, equal_nan=True)
