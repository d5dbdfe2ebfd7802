"""int8_gemm built for CPUs without VNNI (`-march=haswell`: AVX2, FMA; csrc/int8_gemm_avx2.h) gives the exact int32
sums of activations within +-64 (and refuses others, which would saturate its products), and from them the same
output bits as dequantize_int32 over those sums and as this machine's build (the VNNI kernel's epilogue, operation
for operation): every register block of rows, the last panel's partial slices, bias, outlier channels, fp32 and bf16
output. CI runs on whichever CPU kind it gets, so the AVX2 code is built and run here
too (haswell_build.py)."""

from __future__ import annotations

import pytest
import torch
from haswell_build import build_for_haswell
from test_layers import random_int8

from pagedllm.model import kernels
from pagedllm.model.layers import Int8Weight


@pytest.fixture(scope="module")
def haswell():
    ext = build_for_haswell()
    assert ext.int8_gemm_supported()
    return ext


@pytest.fixture(scope="module")
def ext():
    return kernels.load() or pytest.skip(f"kernels did not build: {kernels.build_error()}")


@pytest.mark.parametrize(("rows", "cols", "inputs"), [
    (1, 1000, 576), (2, 1000, 576), (3, 130, 576), (5, 1000, 576), (6, 1000, 576), (13, 130, 576),
    (100, 200, 64), (200, 7, 12), (7, 64, 1536),
])
def test_the_avx2_build_gives_the_exact_sums_and_the_same_bits(haswell, ext, rows, cols, inputs):
    q, w = random_int8((rows, inputs), rows + 1, 64), random_int8((cols, inputs), cols + inputs)
    w[0, :], q[0, :] = 127, -64  # the extremes: 255 * -64 per product before the offset comes off
    q[-1, :2] = 64  # a pair of products at vpmaddubsw's positive limit, 2 * 255 * 64
    packed = Int8Weight.pack(w)
    acc = torch.empty(rows, cols, dtype=torch.int32)
    haswell.int8_gemm(q, packed, None, None, None, acc)
    assert torch.equal(acc.long(), q.long() @ w.long().T)
    gen = torch.Generator().manual_seed(rows)
    row_scale, col_scale = torch.rand(rows, generator=gen) / 100, torch.rand(cols, generator=gen) / 100
    big, extra_w = torch.randn(rows, 3, generator=gen) * 20, torch.randn(3, cols, generator=gen)
    bias = torch.randn(cols, generator=gen)
    whole, picked = torch.randn(5, cols, generator=gen), torch.tensor([4, 0, 2])  # rows read in place by index
    whole[picked] = extra_w
    for dtype in (torch.float32, torch.bfloat16):
        for b, extra in ((None, ()), (bias.to(dtype), ()), (None, (big, extra_w.to(dtype))),
                         (None, (big, whole.to(dtype), picked))):
            out, ref = torch.empty(rows, cols, dtype=dtype), torch.empty(rows, cols, dtype=dtype)
            haswell.int8_gemm(q, packed, row_scale, col_scale, b, out, *extra)
            if b is None:  # dequantize_int32 adds a bias in its own rounding; the VNNI kernel's epilogue as this one
                ext.dequantize_int32(acc, row_scale, col_scale, None, ref, *extra)
                assert torch.equal(out, ref), (dtype, len(extra))
            if ext.int8_gemm_supported():  # this machine's build (VNNI, or AVX2 itself)
                ext.int8_gemm(q, packed, row_scale, col_scale, b, ref, *extra)
                assert torch.equal(out, ref), (dtype, b is None, len(extra))


def test_the_avx2_build_refuses_activations_it_would_saturate(haswell):
    """Past +-64, a pair of products against the weight's 255 leaves vpmaddubsw's int16: an error, not wrong sums."""
    assert haswell.int8_gemm_input_max() == 64
    w = Int8Weight.pack(random_int8((100, 64), 2))
    for bad in (65, -65, 127, -128):
        q = random_int8((7, 64), 1, 64)
        q[3, 5] = bad
        with pytest.raises(RuntimeError, match="within \\+-64"):
            haswell.int8_gemm(q, w, None, None, None, torch.empty(7, 100, dtype=torch.int32))


def test_the_avx2_build_writes_only_its_block_of_columns(haswell):
    q, w = random_int8((7, 64), 1, 64), random_int8((100, 64), 2)
    wide = torch.full((7, 300), -1, dtype=torch.int32)
    haswell.int8_gemm(q, Int8Weight.pack(w), None, None, None, wide[:, 100:200])
    assert torch.equal(wide[:, 100:200].long(), q.long() @ w.long().T)
    assert (wide[:, :100] == -1).all() and (wide[:, 200:] == -1).all()
