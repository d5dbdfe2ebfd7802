"""Paged attention: the C++ kernel against the reference, the reference against dense causal attention."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.model import attention, kernels
from pagedllm.model.attention import (
    KV_GROUP,
    dequantize_kv,
    is_fast_path_available,
    kv_record_len,
    paged_attention,
    quantize_kv,
    rotate_and_store,
    write_kv,
)
from pagedllm.model.layers import RotaryEmbedding

# (context_len, new tokens) per sequence: decodes, whole prompts, chunks after a cached prefix, contexts and
# prefixes on block boundaries (16, 32, 48, 64), a context of one token, and chunks long enough for several
# query tiles and key chunks of the tiled kernel.
MIXED = [(17, 1), (32, 1), (1, 1), (48, 16), (16, 16), (100, 37), (5, 2), (64, 3), (230, 130), (129, 1)]
MANY_DECODES = [(n, 1) for n in (3, 16, 31, 32, 33, 64, 65, 200, 7, 90, 128, 150, 11, 47, 300, 96)]

ROWS, TILE, DEFAULT = 10**9, 1, attention.STATIC_ROUTE.tile_min_rows  # force the row kernel, the tiled one, or pick


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    keys: list[torch.Tensor]  # per sequence, contiguous [ctx, kv_heads, head_dim], as stored in the cache
    values: list[torch.Tensor]

    def run(self, backend: str = "reference", tile_min_rows: int | None = None, pairs: bool = True) -> torch.Tensor:
        """`tile_min_rows` (and `pairs`, the tiled kernel's bf16 form): the C++ kernel with that route."""
        args = (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.query_start_loc,
                self.q.shape[-1] ** -0.5, self.max_query_len)
        if tile_min_rows is not None:
            return attention.cpp_attention(*args, attention.AttentionRoute(tile_min_rows, tile_min_rows, pairs))
        return paged_attention(*args, backend=backend)


def make_batch(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype = torch.float32, seed: int = 0, kv_int8: bool = False) -> Batch:
    """Random K/V written through write_kv into blocks taken in random order; unused slots hold NaN. `kv_int8`:
    the cache holds int8 records (unused ones all 0xFF bytes: NaN scales), keys/values are what they store."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(ctx / block_size) for ctx, _ in specs]
    num_blocks = sum(nblocks) + 3
    order = torch.randperm(num_blocks, generator=gen)
    if kv_int8:
        shape = (num_blocks, block_size, num_kv_heads, kv_record_len(head_dim))
        k_cache, v_cache = (torch.full(shape, 255, dtype=torch.uint8) for _ in range(2))
    else:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache, v_cache = torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)
    block_tables = torch.zeros(len(specs), max(nblocks) + 1, dtype=torch.int32)  # one padding column
    keys, values, taken = [], [], 0
    for s, (ctx, _) in enumerate(specs):
        blocks = order[taken : taken + nblocks[s]]
        taken += nblocks[s]
        block_tables[s, : len(blocks)] = blocks
        pos = torch.arange(ctx)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        k, v = k.to(dtype), v.to(dtype)
        write_kv(k, v, k_cache, v_cache, slots)
        if kv_int8:
            k, v = (dequantize_kv(quantize_kv(x), head_dim) for x in (k, v))
        keys.append(k)
        values.append(v)
    counts = torch.tensor([n for _, n in specs])
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = counts.cumsum(0)
    q = torch.randn(int(counts.sum()), num_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32)
    return Batch(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, int(counts.max()), keys, values)


def dense_attention(b: Batch) -> torch.Tensor:
    """Plain causal attention over each sequence's whole context on contiguous tensors (fp32)."""
    out = []
    starts = b.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(b.keys, b.values, strict=True)):
        ctx, n = k.shape[0], starts[s + 1] - starts[s]
        q = torch.zeros(ctx, b.q.shape[1], b.q.shape[2])
        q[ctx - n :] = b.q[starts[s] : starts[s + 1]].float()  # earlier positions: dummy queries, discarded
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
                                           is_causal=True, enable_gqa=True)
        out.append(o.transpose(0, 1)[ctx - n :])
    return torch.cat(out)


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    tol = 1e-5 if out.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def cpp() -> None:
    if not is_fast_path_available():
        pytest.skip(f"attention kernel did not build: {kernels.build_error()}")


def test_write_kv_puts_each_token_at_its_slot() -> None:
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([22, 3, 4, 17, 0])
    write_kv(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 4, slot % 4], k[i])
        assert torch.equal(v_cache[slot // 4, slot % 4], v[i])
    assert k_cache.flatten(0, 1).abs().sum(dim=(1, 2)).count_nonzero() == 5  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_writer_copies_each_row_to_its_slot(cpp: None, dtype: torch.dtype) -> None:
    qkv = torch.randn(5, 4 * 16, dtype=dtype)  # k and v as strided views of one projection, as in the model
    k, v = qkv[:, 32:48].view(5, 1, 16), qkv[:, 48:].view(5, 1, 16)
    k_cache, v_cache = torch.zeros(6, 4, 1, 16, dtype=dtype), torch.zeros(6, 4, 1, 16, dtype=dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([22, 3, 4, 17, 0], dtype=torch.int32)
    write_kv(k, v, k_cache, v_cache, slots)
    write_kv(k, v, expected_k, expected_v, slots)
    k_cache.zero_(), v_cache.zero_()
    write_kv(k, v, k_cache, v_cache, slots, kernels.load())
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert expected_k.count_nonzero() == 5 * 16


@pytest.mark.parametrize("head_dim", [48, 24], ids=["vectors", "vector-and-tail"])
def test_cpp_writer_rounds_fp32_into_a_bf16_cache_as_torch_does(cpp: None, head_dim: int) -> None:
    """Every value bit for bit what .to(torch.bfloat16) gives: random bit patterns over all exponents, ties to even
    (both parities), values that round up to inf, infinities, subnormals, -0; NaN stays NaN."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (6, 2, head_dim), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[0, 0, :8] = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000, -0x800000, 0x00008000,
                                   -(2**31)], dtype=torch.int32)  # ties, to inf, +-inf, a subnormal tie, -0
    qkv = torch.cat([bits.view(torch.float32), torch.randn(6, 2, head_dim, generator=gen)], dim=1)
    k, v = qkv[:, :2], qkv[:, 2:]  # strided views, as out of a fused projection
    slots = torch.tensor([9, 0, 4, 3, 14, 7])
    k_cache, v_cache = (torch.zeros(4, 4, 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    write_kv(k, v, k_cache, v_cache, slots, kernels.load())
    for cache, x in ((k_cache, k), (v_cache, v)):
        got, want = cache.flatten(0, 1)[slots], x.to(torch.bfloat16)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_write_kv_casts_to_the_cache_dtype() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16), torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 1, 16)
    write_kv(k, k, k_cache, v_cache, torch.tensor([5, 0], dtype=torch.int32))
    assert torch.equal(k_cache[1, 1], k[0].bfloat16()) and torch.equal(v_cache[0, 0], k[1].bfloat16())


@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.uint8)],
                         ids=["fp32", "bf16", "fp32-into-bf16", "bf16-into-int8"])
def test_rotate_and_store_in_one_call_equals_its_steps(cpp: None, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """The kernels' one call gives the q and the caches of rotary then write_kv on the same kernels, bit for bit; q is
    a view of the projection, whose v part stays as it was; other slots are not touched."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, tokens, ext = 6, 2, 64, 7, kernels.load()
    rotary = RotaryEmbedding(d, 512, 10000.0, None, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions, slots = torch.randint(0, 512, (tokens,), generator=g), torch.randperm(40, generator=g)[:tokens]
    row = kv_record_len(d) if kv_dtype == torch.uint8 else d
    k_cache, v_cache, expected_k, expected_v = (torch.zeros(10, 4, kv_heads, row, dtype=kv_dtype) for _ in range(4))
    stepped = qkv.clone()
    q, k, v = stepped.view(tokens, -1, d).split([heads, kv_heads, kv_heads], dim=1)
    expected_q, k = rotary(positions, q, k, ext)
    write_kv(k, v, expected_k, expected_v, slots, ext)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    out = rotate_and_store(qkv, positions, rotary, k_cache, v_cache, slots, heads, kv_heads, ext)
    assert out.shape == (tokens, heads, d) and out.data_ptr() == qkv.data_ptr()
    assert torch.equal(out, expected_q) and torch.equal(qkv, stepped) and torch.equal(qkv[:, -kv_heads * d:], v_before)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert k_cache.flatten(0, 1).count_nonzero(dim=(1, 2)).count_nonzero() == tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_records_hold_each_value_within_half_a_step(dtype: torch.dtype) -> None:
    x = (torch.randn(50, 3, 64) * torch.logspace(-3, 2, 64)).to(dtype)  # groups of very different ranges
    x[7, 1, :32] = 0.5  # a constant group: scale 0
    records = quantize_kv(x)
    assert records.dtype == torch.uint8 and records.shape == (50, 3, kv_record_len(64))
    params = records[..., 64:].contiguous().view(torch.float16).float().reshape(50, 3, 64 // KV_GROUP, 2)
    step = params[..., 0].repeat_interleave(KV_GROUP, dim=-1)
    err = (dequantize_kv(records, 64) - x.float()).abs()
    assert (err <= step / 2 + 1e-3 * x.float().abs() + 1e-6).all()  # + the fp16 rounding of each group's min
    assert torch.equal(dequantize_kv(records, 64)[7, 1, :32], torch.full((32,), 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_int8_writer_stores_the_same_bytes_as_the_torch_one(cpp: None, dtype: torch.dtype) -> None:
    # k and v as strided views of one projection, as in the model; groups of very different ranges, a constant one
    qkv = (torch.randn(9, 5 * 64) * torch.logspace(-3, 2, 5 * 64)).to(dtype)
    qkv[4, 64 + 16:64 + 32] = 0.5
    k, v = qkv[:, 64:192].view(9, 2, 64), qkv[:, 192:].view(9, 2, 64)
    k_cache, v_cache = (torch.zeros(4, 4, 2, kv_record_len(64), dtype=torch.uint8) for _ in range(2))
    slots = torch.tensor([15, 0, 3, 4, 9, 10, 11, 1, 2])
    write_kv(k, v, k_cache, v_cache, slots, kernels.load())
    assert torch.equal(k_cache.flatten(0, 1)[slots], quantize_kv(k))
    assert torch.equal(v_cache.flatten(0, 1)[slots], quantize_kv(v))
    assert k_cache.flatten(0, 1)[[5, 6, 7, 8, 12, 13, 14]].count_nonzero() == 0  # nothing else written


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)])
def test_reference_equals_dense_causal_attention(heads: tuple[int, int], block_size: int) -> None:
    b = make_batch(MIXED, *heads, 32, block_size)
    assert_close(b.run("reference"), dense_attention(b))


@pytest.mark.parametrize("kernel", [ROWS, TILE, DEFAULT], ids=["rows", "tile", "default"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_equals_reference_on_mixed_batch(cpp: None, dtype: torch.dtype, heads: tuple[int, int], head_dim: int,
                                             block_size: int, kernel: int) -> None:
    b = make_batch(MIXED, *heads, head_dim, block_size, dtype)
    out = b.run(tile_min_rows=kernel)
    assert out.dtype == dtype and out.shape == b.q.shape
    assert_close(out, b.run("reference"))


@pytest.mark.parametrize("specs", [[(1000, 1)], [(16, 16)], [(333, 333)], [(500, 300)], MANY_DECODES],
                         ids=["one-long-decode", "one-block-prompt", "one-prompt", "one-chunk-after-prefix",
                              "many-decodes"])
@pytest.mark.parametrize("heads", [(12, 12), (9, 3)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_equals_reference_on_single_sequences_and_big_batches(cpp: None, dtype: torch.dtype,
                                                                 heads: tuple[int, int], specs: list) -> None:
    b = make_batch(specs, *heads, 64, 16, dtype)
    assert_close(b.run("cpp"), b.run("reference"))


@pytest.mark.parametrize("head_dim", [80, 128])
def test_bf16_prompt_tiles_equal_reference_at_other_head_dims(cpp: None, head_dim: int) -> None:
    """The tiled kernel's bf16 path at head_dims past one 64-value block: its values' sums in blocks of 64 then 16."""
    b = make_batch([(333, 333), (100, 37), (230, 130), (7, 7)], 9, 3, head_dim, 16, torch.bfloat16)
    out = b.run(tile_min_rows=TILE)
    assert out.dtype == torch.bfloat16 and out.shape == b.q.shape
    assert_close(out, b.run("reference"))


@pytest.mark.parametrize("kernel", [ROWS, TILE, DEFAULT], ids=["rows", "tile", "default"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_cache_cpp_equals_reference_and_dense(cpp: None, dtype: torch.dtype, heads: tuple[int, int],
                                                   head_dim: int, block_size: int, kernel: int) -> None:
    """The kernel over int8 records equals attention over the values they hold (unused records would be NaN)."""
    b = make_batch(MIXED + MANY_DECODES[:4], *heads, head_dim, block_size, dtype, kv_int8=True)
    out = b.run(tile_min_rows=kernel)
    assert out.dtype == dtype and out.shape == b.q.shape
    assert_close(out, b.run("reference"))
    assert_close(out, dense_attention(b))


SHARED_SPECS = [(420, 420), (300, 210), (97, 42)]  # 21 queries x 3 heads a tile: 20, 10 and 2 tiles in a whole call


def assert_each_tile_equals_it_alone(b: Batch, route: attention.AttentionRoute) -> None:
    """Every tile of 21 queries of a whole call over SHARED_SPECS (its full key chunks prepared once for all its
    tiles: csrc/tile_shared.h) gets the bits it gets as its call's only tile (preparing each chunk itself)."""
    def attend(x: Batch) -> torch.Tensor:
        return attention.cpp_attention(x.q, x.k_cache, x.v_cache, x.block_tables, x.context_lens, x.query_start_loc,
                                       x.q.shape[-1] ** -0.5, x.max_query_len, route)
    whole, starts = attend(b), b.query_start_loc.tolist()
    for s, (ctx, n) in enumerate(SHARED_SPECS):
        for i0 in range(0, n, 21):
            rows = slice(starts[s] + i0, starts[s] + i0 + 21)
            one = Batch(b.q[rows], b.k_cache, b.v_cache, b.block_tables[s:s + 1],
                        torch.tensor([ctx - n + i0 + 21], dtype=torch.int32), torch.tensor([0, 21], dtype=torch.int32),
                        21, b.keys, b.values)
            assert torch.equal(attend(one), whole[rows]), (s, i0)


@pytest.mark.parametrize(("queries", "kv_int8"), [(torch.float32, False), (torch.bfloat16, False),
                                                  (torch.float32, True)],
                         ids=["fp32-queries-bf16-cache", "bf16-queries", "int8-cache"])
def test_the_fp32_tiles_shared_chunks_give_each_tile_its_own_bits(cpp: None, queries: torch.dtype,
                                                                   kv_int8: bool) -> None:
    """The fp32 tile over a bf16 or int8 cache converts each chunk to fp32 rows: once per call for the chunks
    several tiles share. Several sequences, blocks of 5 keys (chunks across blocks), prompts after a prefix."""
    b = make_batch(SHARED_SPECS, 9, 3, 64, 5, torch.float32 if kv_int8 else torch.bfloat16, kv_int8=kv_int8)
    b.q = b.q.to(queries)
    assert_each_tile_equals_it_alone(b, attention.AttentionRoute(1, 1, False, False))


def test_fp32_kernel_matches_dense_attention_tightly(cpp: None) -> None:
    b = make_batch(MIXED + MANY_DECODES, 9, 3, 64, 16)
    torch.testing.assert_close(b.run("cpp"), dense_attention(b), rtol=1e-5, atol=2e-6)


# Few long decodes (the tail of a run): too few work items for the threads, so each context is split into
# partitions that run in parallel and are merged (flash-decoding). Also a short chunk (rows kernel, 3 queries)
# and a mix with a short decode that is split by kv head instead.
FEW_LONG = [[(1300, 1)], [(700, 1), (1200, 1)], [(513, 1), (64, 1), (900, 1)], [(1000, 3)], [(257, 1)]]


@pytest.fixture(params=[2, 3, 4], ids=["2threads", "3threads", "4threads"])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("specs", FEW_LONG, ids=["one", "two", "three", "chunk", "short"])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)], ids=["gqa3", "gqa4", "gqa1"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_split_context_fp32_matches_dense_attention_tightly(cpp: None, threads: int, specs: list,
                                                          heads: tuple[int, int], block_size: int) -> None:
    b = make_batch(specs, *heads, 64, block_size)
    torch.testing.assert_close(b.run("cpp"), dense_attention(b), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kv_int8", [False, True], ids=["bf16-cache", "int8-cache"])
@pytest.mark.parametrize("specs", FEW_LONG, ids=["one", "two", "three", "chunk", "short"])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_split_context_bf16_equals_reference(cpp: None, threads: int, specs: list, head_dim: int,
                                             kv_int8: bool) -> None:
    b = make_batch(specs, 9, 3, head_dim, 16, torch.bfloat16, kv_int8=kv_int8)
    assert_close(b.run("cpp"), b.run("reference"))


# fp32 queries over a bf16 cache (a model run in fp32 with a bf16 KV cache): decodes and short chunks read the bf16
# rows in place, widened in registers, when head_dim is a multiple of 32 (32, 64, 128 compiled for, 96 at run time);
# head_dim 48 takes the generic kernel. G = 1, 3, 4, 6: query rows per kv head in 3s and the remainders.
FP32_Q_HEADS = [(9, 3), (8, 2), (12, 2), (4, 4)]


@pytest.mark.parametrize("specs", [MANY_DECODES, MIXED], ids=["many-decodes", "mixed"])
@pytest.mark.parametrize("heads", FP32_Q_HEADS, ids=["gqa3", "gqa4", "gqa6", "gqa1"])
@pytest.mark.parametrize("head_dim", [64, 32, 128, 96, 48])
@pytest.mark.parametrize("block_size", [16, 5])
def test_fp32_queries_over_bf16_cache_equal_reference(cpp: None, specs: list, heads: tuple[int, int], head_dim: int,
                                                      block_size: int) -> None:
    b = make_batch(specs, *heads, head_dim, block_size, torch.bfloat16)
    fp32_q = Batch(**{**b.__dict__, "q": b.q.float()})
    out = fp32_q.run("cpp")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fp32_q.run("reference"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("specs", [MANY_DECODES, FEW_LONG[2]], ids=["many-decodes", "split"])
@pytest.mark.parametrize("heads", FP32_Q_HEADS, ids=["gqa3", "gqa4", "gqa6", "gqa1"])
@pytest.mark.parametrize("head_dim", [64, 32, 128])
def test_bf16_queries_decode_as_widened_fp32_ones_where_the_route_takes_no_vdpbf16ps(
        cpp: None, specs: list, heads: tuple[int, int], head_dim: int) -> None:
    """Where the route does not take vdpbf16ps for bf16 queries (tile_pairs off: measured slower, as on the Intel
    Xeon model 207; or a CPU without it), their decode over a bf16 cache is the fp32 queries' kernel on them
    widened: its output rounded to bf16, bit for bit (contexts split over the threads too)."""
    b = make_batch(specs, *heads, head_dim, 16, torch.bfloat16)
    widened = Batch(**{**b.__dict__, "q": b.q.float()})
    out = b.run(tile_min_rows=ROWS, pairs=False)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, widened.run(tile_min_rows=ROWS, pairs=False).to(torch.bfloat16))


def test_bf16_queries_decode_on_vdpbf16ps_where_the_route_takes_it(cpp: None) -> None:
    """The other side of the route: with tile_pairs on, on a CPU with AVX512-BF16, bf16 queries' decode runs its
    vdpbf16ps scores, whose sums round in another order than the widened fp32 form's (so some output bits differ),
    and stays close to the reference."""
    if not kernels.load().tile_pairs_supported():
        pytest.skip("no AVX512-BF16: bf16 queries' decode has only the fp32 form")
    differ = 0
    for head_dim in (64, 32, 128):
        b = make_batch(MANY_DECODES, 9, 3, head_dim, 16, torch.bfloat16)
        pairs = b.run(tile_min_rows=ROWS, pairs=True)
        assert_close(pairs, b.run("reference"))
        differ += not torch.equal(pairs, b.run(tile_min_rows=ROWS, pairs=False))
    assert differ > 0


@pytest.mark.parametrize("specs", FEW_LONG, ids=["one", "two", "three", "chunk", "short"])
@pytest.mark.parametrize("heads", FP32_Q_HEADS[:2], ids=["gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_split_context_fp32_queries_over_bf16_cache_equal_reference(cpp: None, threads: int, specs: list,
                                                                    heads: tuple[int, int], head_dim: int) -> None:
    b = make_batch(specs, *heads, head_dim, 16, torch.bfloat16)
    fp32_q = Batch(**{**b.__dict__, "q": b.q.float()})
    torch.testing.assert_close(fp32_q.run("cpp"), fp32_q.run("reference"), rtol=1e-5, atol=1e-5)


def test_split_context_agrees_with_one_thread(cpp: None) -> None:
    """The partitions' merge gives one pass's result up to fp32 rounding (one thread: no split)."""
    b = make_batch([(1500, 1), (600, 2)], 9, 3, 64, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = b.run("cpp")
        torch.set_num_threads(4)
        split = b.run("cpp")
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)


def test_auto_backend_uses_the_kernel(cpp: None) -> None:
    b = make_batch(MIXED, 6, 2, 64, 16)
    assert torch.equal(b.run("auto"), b.run("cpp"))


def test_cpp_accepts_strided_queries_and_mixed_dtypes(cpp: None) -> None:
    b = make_batch(MIXED, 6, 2, 64, 16)
    qkv = torch.randn(b.q.shape[0], 10, 64)
    qkv[:, :6] = b.q  # q as a view into a fused projection output
    strided = Batch(**{**b.__dict__, "q": qkv[:, :6]})
    assert_close(strided.run("cpp"), b.run("reference"))
    bf16_cache = make_batch(MIXED, 6, 2, 64, 16, torch.bfloat16)
    fp32_q = Batch(**{**bf16_cache.__dict__, "q": bf16_cache.q.float()})
    out = fp32_q.run("cpp")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fp32_q.run("reference"), rtol=1e-5, atol=1e-5)


def test_cpp_skips_sequences_without_queries(cpp: None) -> None:
    b = make_batch([(20, 1), (40, 3), (9, 1)], 4, 2, 32, 16)
    qsl = torch.tensor([0, 1, 1, 2], dtype=torch.int32)  # the middle sequence has no new tokens this step
    skipped = Batch(**{**b.__dict__, "q": b.q[[0, 4]], "query_start_loc": qsl})
    assert_close(skipped.run("cpp"), skipped.run("reference"))


def test_cpp_rejects_bad_block_tables(cpp: None) -> None:
    b = make_batch([(20, 1)], 4, 2, 32, 16)
    b.block_tables[0, 1] = b.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        b.run("cpp")
    b = make_batch([(20, 1)], 4, 2, 32, 16)
    b.context_lens[0] = 100  # needs 7 blocks; its table row holds 3
    with pytest.raises(RuntimeError, match="block table too short"):
        b.run("cpp")


def test_auto_falls_back_to_reference_with_a_warning_for_unsupported_shapes() -> None:
    b = make_batch([(20, 1), (12, 12)], 4, 2, 40, 16)  # head_dim 40 is not a multiple of 16
    with pytest.warns(RuntimeWarning, match="head_dim 40"):
        out = b.run("auto")
    assert torch.equal(out, b.run("reference"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        b.run("cuda")


def test_failed_build_falls_back_to_reference_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error no compiler here\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(kernels, "_SOURCES", [broken])
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_ext_error", None)
    monkeypatch.setattr(attention, "_warned", set())
    b = make_batch([(20, 1), (12, 12)], 4, 2, 32, 16)
    assert not is_fast_path_available()
    with pytest.warns(RuntimeWarning, match="kernel build failed"):
        out = b.run("auto")
    assert torch.equal(out, b.run("reference"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.run("auto")  # warned once only
    with pytest.raises(RuntimeError, match="failed to build"):
        b.run("cpp")


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
       head_dim=st.sampled_from([16, 32, 64]), block_size=st.sampled_from([1, 2, 5, 16]),
       kernel=st.sampled_from([ROWS, TILE, DEFAULT]))
def test_cpp_equals_reference_on_random_shapes(data: st.DataObject, num_kv_heads: int, group: int, head_dim: int,
                                               block_size: int, kernel: int) -> None:
    if not is_fast_path_available():
        pytest.skip("attention kernel did not build")
    contexts = data.draw(st.lists(st.integers(1, 80), min_size=1, max_size=5))
    specs = [(ctx, data.draw(st.integers(1, ctx))) for ctx in contexts]
    b = make_batch(specs, num_kv_heads * group, num_kv_heads, head_dim, block_size, seed=len(specs))
    assert_close(b.run(tile_min_rows=kernel), b.run("reference"))
