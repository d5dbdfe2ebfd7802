"""top_k_logsumexp built for CPUs without AVX-512 (`-march=haswell`; its maxima and top-k filter in AVX2 vectors,
csrc/top_k.cpp) gives each row's top 16 and logsumexp as torch does, as this machine's build does: ties, a row's
tail past the last 16 values, chunks a grammar masked out, fp32 and bf16 rows. CI runs on whichever CPU kind it
gets, so the AVX2 code is built and run here too (haswell_build.py)."""

from __future__ import annotations

import pytest
import torch
from haswell_build import build_for_haswell

from pagedllm.model import kernels


@pytest.fixture(scope="module")
def haswell():
    return build_for_haswell()


@pytest.fixture(scope="module")
def ext():
    return kernels.load() or pytest.skip(f"kernels did not build: {kernels.build_error()}")


def logits_with_edges(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 9,000 logits (two 4,096-value chunks and a tail of 808, not a multiple of 16) with ties at the top,
    the largest value in the tail, and the first chunk masked out (-inf), as a grammar does."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 9000, generator=g) * 4
    x[1, 100:140] = 50.0
    x[2, 8995] = 60.0
    x[3, :4096] = float("-inf")
    x[4, 4096:] = float("-inf")
    x[5, ::2] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_gives_torchs_top_k_and_logsumexp(haswell, ext, dtype: torch.dtype) -> None:
    logits = logits_with_edges(dtype)
    values, ids, lse = haswell.top_k_logsumexp(logits, 16)
    ref = logits.float()
    order = torch.sort(-ref, dim=-1, stable=True)
    assert torch.equal(values, -order.values[:, :16]) and torch.equal(ids, order.indices[:, :16])
    assert ids[1].tolist() == list(range(100, 116)) and ids[2, 0] == 8995
    torch.testing.assert_close(lse, ref.logsumexp(-1))
    native = ext.top_k_logsumexp(logits, 16)
    assert torch.equal(native[0], values) and torch.equal(native[1], ids)
    torch.testing.assert_close(native[2], lse, rtol=1e-6, atol=0)
