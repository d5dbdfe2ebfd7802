"""Prompt chunks on torch's flash attention (model/attention_sdpa.py): the same attention as the reference whatever
the mix of chunks, chunks after cached keys, decodes and padding rows; and only where the route and dtypes allow it."""

from __future__ import annotations

import pytest
import torch
from test_attention import MIXED, assert_close, make_batch

from pagedllm.model import attention, attention_sdpa, kernels
from pagedllm.model.attention import AttentionRoute


@pytest.fixture(scope="module", autouse=True)
def cpp() -> None:
    if not attention.is_fast_path_available():
        pytest.skip(f"attention kernel did not build: {kernels.build_error()}")


def run(b, min_queries: int, q: torch.Tensor | None = None) -> torch.Tensor:
    return attention.cpp_attention(q if q is not None else b.q, b.k_cache, b.v_cache, b.block_tables,
                                   b.context_lens, b.query_start_loc, b.q.shape[-1] ** -0.5, b.max_query_len,
                                   AttentionRoute(20, 20, True, False, min_queries))


@pytest.mark.parametrize("min_queries", [1, 16, 100], ids=["every-sequence", "chunks-and-decodes", "one-chunk"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
def test_flash_attention_chunks_equal_the_reference_in_a_mixed_batch(heads: tuple[int, int], block_size: int,
                                                                      min_queries: int) -> None:
    """MIXED holds prompts whose chunk is their whole context (16 of 16) and chunks after cached keys (37 of 100,
    130 of 230), beside decodes: each group of `min_queries` or more on flash attention, the rest on the kernel."""
    b = make_batch(MIXED, *heads, 64, block_size, torch.bfloat16)
    assert attention_sdpa.applies(b.q.dtype, b.k_cache, b.max_query_len, min_queries)
    out = run(b, min_queries)
    assert out.dtype == torch.bfloat16 and out.shape == b.q.shape
    assert_close(out, b.run("reference"))


def test_rows_outside_the_sequences_come_back_zero() -> None:
    """A padded step: rows before the first sequence's queries and after the last are zeros, as the kernel leaves
    them."""
    b = make_batch([(300, 300), (40, 1), (500, 120)], 9, 3, 64, 16, torch.bfloat16)
    padded = torch.cat([torch.randn(2, 9, 64).bfloat16(), b.q, torch.randn(5, 9, 64).bfloat16()])
    b.query_start_loc += 2
    out = run(b, 64, padded)
    assert not out[:2].any() and not out[-5:].any()
    b.query_start_loc -= 2
    assert_close(out[2:-5], b.run("reference"))


def test_only_bf16_chunks_of_the_routes_size_take_it() -> None:
    bf16 = make_batch([(200, 200)], 6, 2, 64, 16, torch.bfloat16)
    assert attention_sdpa.applies(bf16.q.dtype, bf16.k_cache, 200, 200)
    assert not attention_sdpa.applies(bf16.q.dtype, bf16.k_cache, 199, 200)  # no chunk that long in this step
    assert not attention_sdpa.applies(bf16.q.dtype, bf16.k_cache, 200, 0)  # the route never takes it
    fp32 = make_batch([(200, 200)], 6, 2, 64, 16)
    assert not attention_sdpa.applies(fp32.q.dtype, fp32.k_cache, 200, 1)  # fp32 stays on the exact kernel
    int8 = make_batch([(200, 200)], 6, 2, 64, 16, torch.bfloat16, kv_int8=True)
    assert not attention_sdpa.applies(int8.q.dtype, int8.k_cache, 200, 1)  # int8 records: the kernel reads them
    assert_close(run(int8, 1), int8.run("reference"))
