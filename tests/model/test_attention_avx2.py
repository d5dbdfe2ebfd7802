"""The paged attention kernel built for CPUs without AVX-512 (`-march=haswell`: AVX2, FMA, F16C; its AVX2 paths:
csrc/attention_avx2.h and attend_tile.h's 8-float micro-kernel and softmax) equals the reference, through the row
kernel and the tiled one, over fp32 and bf16 caches. CI runs on whichever CPU kind it gets, so the AVX2 code is built
and run here too (haswell_build.py)."""

from __future__ import annotations

import pytest
import torch
from haswell_build import build_for_haswell
from test_attention import MANY_DECODES, MIXED, assert_close, make_batch

ROWS, TILE = 1 << 30, 1


@pytest.fixture(scope="module")
def haswell():
    return build_for_haswell()


@pytest.mark.parametrize("kernel", [ROWS, TILE], ids=["rows", "tile"])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16)], ids=["fp32", "fp32-bf16kv", "bf16"])
def test_the_avx2_build_equals_the_reference(haswell, dtype, kv_dtype, heads, kernel):
    b = make_batch(MIXED + MANY_DECODES[:4], *heads, 64, 16, kv_dtype)
    b.q = torch.randn(b.q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = haswell.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens.int(),
                                  b.query_start_loc.int(), b.q.shape[-1] ** -0.5, b.max_query_len, kernel, kernel,
                                  True, True)
    assert out.dtype == dtype and out.shape == b.q.shape
    assert_close(out, b.run("reference"))
