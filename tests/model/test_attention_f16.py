"""The tiled attention kernel's fp16-products form (csrc/tile_f16.h: fp32 queries over a bf16 cache, AVX512-FP16,
where `--dtype auto` chose fp32): its error against float64 attention over the same cache stays within what rounding
the queries to bf16 would cost, at any scale of queries, keys and values (powers of two keep every fp16 sum finite);
a query's output does not depend on the tile or the step it is attended in; and the form runs only where the route
and the dtypes allow it."""

from __future__ import annotations

import pytest
import torch
from test_attention import SHARED_SPECS, Batch, assert_each_tile_equals_it_alone, make_batch

from pagedllm.model import kernels
from pagedllm.model.attention import AttentionRoute, cpp_attention

FP32_TILE, F16_TILE = AttentionRoute(1, 1, True, False), AttentionRoute(1, 1, True, True)
# prompts whole and after a prefix, several query tiles and key chunks, short ones, a one-token context
PROMPTS = [(333, 333), (100, 37), (230, 130), (7, 7), (500, 200), (1, 1)]


@pytest.fixture(scope="module", autouse=True)
def ext():
    ext = kernels.load() or pytest.skip(f"kernels did not build: {kernels.build_error()}")
    if not ext.tile_f16_supported():
        pytest.skip("no AVX512-FP16: the tiles have no fp16 form here")
    return ext


def attend(b: Batch, route: AttentionRoute) -> torch.Tensor:
    return cpp_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.query_start_loc,
                         b.q.shape[-1] ** -0.5, b.max_query_len, route)


def exact(b: Batch, q: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention in float64 over the keys and values the cache holds (`q`: other queries)."""
    q = b.q if q is None else q
    starts, out = b.query_start_loc.tolist(), []
    group = q.shape[1] // b.keys[0].shape[1]
    for s, (k, v) in enumerate(zip(b.keys, b.values, strict=True)):
        ctx, n = k.shape[0], starts[s + 1] - starts[s]
        k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[starts[s]:starts[s + 1]].double(), k) * q.shape[-1] ** -0.5
        hidden = torch.arange(ctx).unsqueeze(0) > torch.arange(ctx - n, ctx).unsqueeze(1)
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v))
    return torch.cat(out)


def error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference).norm() / reference.norm()).item()


def fp32_queries(specs: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, block_size: int = 16,
                 q_scale: float = 1.0, k_scale: float = 1.0, v_scale: float = 1.0) -> Batch:
    """fp32 queries (3x unit scale: peaked softmaxes, as a model's) over a bf16 cache, each scaled as asked."""
    b = make_batch(specs, *heads, head_dim, block_size, torch.bfloat16)
    b.q = torch.randn(b.q.shape, generator=torch.Generator().manual_seed(1)) * 3 * q_scale
    for cache, scale, rows in ((b.k_cache, k_scale, b.keys), (b.v_cache, v_scale, b.values)):
        if scale != 1.0:
            cache.copy_((cache.float() * scale).bfloat16())
            rows[:] = [(x.float() * scale).bfloat16() for x in rows]
    return b


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa3", "gqa1"])
def test_error_stays_within_bf16_queries_rounding(heads, head_dim):
    """Against float64 over the same cache: the fp16 form's error is below 1.25x what rounding the queries to bf16
    alone costs (about 0.3% here; the exact fp32 tile's is ~1e-6), and it is really the fp16 form that ran."""
    b = fp32_queries(PROMPTS, heads, head_dim)
    reference = exact(b)
    f16, fp32 = attend(b, F16_TILE), attend(b, FP32_TILE)
    bf16_queries = error(exact(b, b.q.bfloat16().float()), reference)
    assert error(fp32, reference) < 1e-5
    assert 1e-5 < error(f16, reference) < 1.25 * bf16_queries, (error(f16, reference), bf16_queries)


@pytest.mark.parametrize(("q_scale", "v_scale"), [(1e-20, 1.0), (1e20, 1e6), (1e-4, 1e-8), (1e4, 1e30), (1.0, 1e-30)])
def test_any_fp32_scale_stays_finite_and_close(q_scale, v_scale):
    """Queries or keys of 1e4 to 1e20 and values of 1e6 or more overflow fp16 (65504), 1e-4 to 1e-30 fall below its
    subnormals: the powers of two that scale query rows and each chunk's keys and values keep them in range, and
    are divided out exactly. (Keys scaled by 1 / q_scale: the same scores, as well conditioned as at scale 1.)"""
    b = fp32_queries(PROMPTS[:4], (9, 3), 64, q_scale=q_scale, k_scale=1 / q_scale, v_scale=v_scale)
    out, reference = attend(b, F16_TILE), exact(b)
    assert torch.isfinite(out).all()
    assert error(out, reference) < 2e-2


def test_zero_queries_and_keys_give_the_values_mean():
    b = fp32_queries([(200, 200)], (9, 3), 64)
    b.q.zero_()
    torch.testing.assert_close(attend(b, F16_TILE).double(), exact(b), rtol=5e-3, atol=5e-3)


def test_a_query_gets_the_same_bits_whatever_the_step_it_is_attended_in():
    """A prompt attended at once, and the same prompt as chunks of 150 after a prefix (chunked prefill): each query
    row's fp16 sums take the same products in the same order (rows never mix; key chunks start at the same positions;
    the scales are powers of two), so the outputs agree bit for bit."""
    b = fp32_queries([(450, 450)], (9, 3), 64)
    whole = attend(b, F16_TILE)
    pieces = []
    for start in (0, 150, 300):
        part = Batch(b.q[start:start + 150], b.k_cache, b.v_cache, b.block_tables, torch.tensor([start + 150],
                     dtype=torch.int32), torch.tensor([0, 150], dtype=torch.int32), 150, b.keys, b.values)
        pieces.append(attend(part, F16_TILE))
    assert torch.equal(torch.cat(pieces), whole)


def test_chunks_packed_once_per_call_give_each_tile_its_own_bits():
    """The full key chunks a call's fp16 tiles share are packed once, before the tiles run (tile_shared.h): each tile
    gets the bits it gets packing them itself."""
    assert_each_tile_equals_it_alone(fp32_queries(SHARED_SPECS, (9, 3), 64, block_size=5), F16_TILE)


def test_only_fp32_queries_over_a_bf16_cache_take_it():
    """bf16 queries keep their own forms and fp32 caches their exact fp32 tile: the flag changes no bit there; the
    row (decode) kernel ignores it."""
    bf16 = make_batch(PROMPTS, 9, 3, 64, 16, torch.bfloat16)
    fp32 = make_batch(PROMPTS, 9, 3, 64, 16, torch.float32)
    for b in (bf16, fp32):
        assert torch.equal(attend(b, F16_TILE), attend(b, FP32_TILE))
    decodes = fp32_queries([(n, 1) for n in (3, 40, 300)] + [(100, 3)], (9, 3), 64)
    rows = (AttentionRoute(10**9, 10**9, True, True), AttentionRoute(10**9, 10**9, True, False))
    assert torch.equal(attend(decodes, rows[0]), attend(decodes, rows[1]))
    prompts = fp32_queries(PROMPTS, (9, 3), 64)
    assert not torch.equal(attend(prompts, F16_TILE), attend(prompts, FP32_TILE))
