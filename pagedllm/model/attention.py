"""Attention over the paged KV cache: the cache write, a readable reference and a fast C++ kernel.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``, in the model's
dtype, or in int8 (``--kv-cache-dtype int8``): uint8 records of ``kv_record_len(head_dim)`` bytes per row, the values
quantised per group of 16 with an fp16 scale and min each (0.625x the bytes of bf16). A step's
queries are flat (``[T, num_heads, head_dim]``, decodes and prompt chunks mixed, no padding); sequence ``s``
owns ``q[query_start_loc[s]:query_start_loc[s+1]]``, which are the last tokens of its context.

Backends: ``"reference"`` gathers each sequence's blocks and runs a masked softmax in fp32 (the oracle of the
tests); ``"cpp"`` runs ``csrc/paged_attention.cpp``, compiled once per source version into the torch
extensions cache on first use; ``"auto"`` takes the kernel when it compiled and otherwise the reference, with
one warning. ``pagedllm bench attention`` (pagedllm/bench/attention.py) times them against each other and against
the same kernel over consecutive blocks and SDPA over a dense cache.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from pagedllm.model import attention_sdpa, kernels
from pagedllm.model.layers import RotaryEmbedding


@dataclass(frozen=True)
class AttentionRoute:
    """Which kernel attends each sequence: the tiled (prefill) one from this many query rows (queries x query heads per
    kv head), the row (decode) one below; `few_tile_min_rows` in steps of fewer than 4 sequences per thread, where
    the row kernel splits contexts over threads. `tile_pairs`: bf16 queries' tiles and decode scores on vdpbf16ps
    where the CPU has it (else their fp32 forms, the queries widened); `tile_f16`: fp32 queries over a bf16 cache
    with fp16 products (AVX512-FP16; only where `--dtype auto` chose fp32). Measured where the engine runs
    (model/attention_dispatch.py)."""

    tile_min_rows: int = 20
    few_tile_min_rows: int = 20
    tile_pairs: bool = True
    tile_f16: bool = False
    sdpa_min_queries: int = 0  # bf16 chunks of this many queries on torch's flash attention (attention_sdpa.py)


STATIC_ROUTE = AttentionRoute()  # the cut-off measured by hand on an Intel Xeon without AVX512-BF16

_warned: set[str] = set()

KV_GROUP = 16  # int8 cache: values sharing one (scale, min) pair, as csrc/paged_attention.cpp's kKvGroup


def kv_record_len(head_dim: int) -> int:
    """Bytes of one kv head's row in an int8 cache: the values, then an fp16 scale and min per group."""
    return head_dim + head_dim // KV_GROUP * 4


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., head_dim]`` to int8 records ``[..., kv_record_len]``: the torch twin of the C++ writer (the same
    fp32 operations and rounding), for the reference path."""
    *lead, d = x.shape
    g = x.float().reshape(*lead, d // KV_GROUP, KV_GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    params = torch.cat([(hi - lo) / 255, lo], dim=-1).half()  # [..., groups, (scale, min)]
    scale, mn = params.float().unbind(-1)
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = ((g - mn[..., None]) * inv[..., None]).round_().clamp_(0, 255).to(torch.uint8)
    return torch.cat([q.reshape(*lead, d), params.reshape(*lead, -1).view(torch.uint8)], dim=-1)


def dequantize_kv(records: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int8 records ``[..., kv_record_len]`` back to fp32 rows ``[..., head_dim]``."""
    *lead, _ = records.shape
    q = records[..., :head_dim].float().reshape(*lead, head_dim // KV_GROUP, KV_GROUP)
    params = records[..., head_dim:].contiguous().view(torch.float16).float().reshape(*lead, -1, 2)
    return (q * params[..., :1] + params[..., 1:]).reshape(*lead, head_dim)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, ext: ModuleType | None = None) -> None:
    """Store the step's new keys/values ``[T, num_kv_heads, head_dim]`` at their cache slots, in place (quantised
    into records in an int8 cache).

    ``slot_mapping[i] = block_id * block_size + offset`` (int64, or int32, converted). With the C++ kernels `ext`,
    one call for K and V, fp32 rows rounded into a bf16 cache as they are stored (the torch path: two vectorised
    copies, the conversion and the quantisation as separate ops).
    """
    slots = slot_mapping.long()
    if ext is not None and _kernel_stores(k.dtype, k_cache) and k.dtype == v.dtype and k.stride(-1) == 1 \
            and v.stride(-1) == 1:
        ext.write_kv(k, v, k_cache, v_cache, slots.contiguous())
        return
    if k_cache.dtype == torch.uint8:
        k, v = quantize_kv(k), quantize_kv(v)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def _kernel_stores(dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
    """The C++ writer stores rows of this dtype into this cache: its own dtype, bf16 from fp32, or int8 records."""
    return k_cache.dtype in (torch.uint8, dtype) or (k_cache.dtype, dtype) == (torch.bfloat16, torch.float32)


def rotate_and_store(qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int, kv_heads: int,
                     ext: ModuleType | None = None) -> torch.Tensor:
    """A layer's fused projection qkv [T, (heads + 2 kv_heads) * head_dim]: q and k rotated by their positions, k and
    v stored at their cache slots; returns q [T, heads, head_dim]. With the C++ kernels `ext`, one call in place (the
    split and views alone took 10.8 us a layer at one row, AMD EPYC Zen 4)."""
    if ext is not None and _kernel_stores(qkv.dtype, k_cache) and qkv.stride(-1) == 1 \
            and slot_mapping.dtype == torch.int64:
        return ext.rotary_write_kv(qkv, rotary.cos, rotary.sin, positions, k_cache, v_cache, slot_mapping, heads,
                                   kv_heads)
    head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
    q, k, v = qkv.view(qkv.shape[0], -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    q, k = rotary(positions, q, k, ext)
    write_kv(k, v, k_cache, v_cache, slot_mapping, ext)
    return q


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    backend: str = "auto", route: AttentionRoute = STATIC_ROUTE) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached context; returns ``q``'s shape and dtype.

    Query ``i`` of a sequence with ``n`` queries and ``context_lens[s]`` cached tokens (this step's included)
    sits at position ``context_lens[s] - n + i`` and sees key positions ``0 ..`` that position.
    """
    step = StepAttention.build(q.dtype, q.shape[-1], k_cache, block_tables, context_lens, query_start_loc, scale,
                               max_query_len, backend, route)
    return step(q, k_cache, v_cache)


@dataclass(frozen=True)
class StepAttention:
    """One step's attention, resolved once for all of its layers: the backend and the metadata as the kernel takes
    it; a layer's call then costs the kernel's. (Resolved per call it took 8 of the 18 us a layer at one row, AMD
    EPYC Zen 4.)"""

    backend: str  # "cpp" or "reference"
    block_tables: torch.Tensor  # int32 [S, max_blocks], contiguous (as the other two)
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_query_len: int
    route: AttentionRoute
    sdpa: bool  # long bf16 chunks go to torch's flash attention (attention_sdpa.py)

    @classmethod
    def build(cls, dtype: torch.dtype, head_dim: int, k_cache: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
              backend: str = "auto", route: AttentionRoute = STATIC_ROUTE) -> StepAttention:
        """`backend`: "auto" takes the C++ kernel where it handles these dtypes and built; "cpp" insists on it."""
        if backend == "auto":
            backend = _pick_backend(dtype, head_dim, k_cache)
        if backend not in ("cpp", "reference"):
            raise ValueError(f"unknown attention backend {backend!r}; expected 'auto', 'reference' or 'cpp'")
        if backend == "cpp" and kernels.load() is None:
            raise RuntimeError(f"pagedllm attention kernel failed to build: {kernels.build_error()}")
        sdpa = backend == "cpp" and attention_sdpa.applies(dtype, k_cache, max_query_len, route.sdpa_min_queries)
        return cls(backend, _int32(block_tables), _int32(context_lens), _int32(query_start_loc), float(scale),
                   int(max_query_len), route, sdpa)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The attention of q [T, heads, head_dim] over one layer's cache."""
        if self.backend == "reference":
            return _reference_attention(q, k_cache, v_cache, self.block_tables, self.context_lens,
                                        self.query_start_loc, self.scale)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if self.sdpa:
            return attention_sdpa.attend(q, k_cache, v_cache, self.block_tables, self.context_lens,
                                         self.query_start_loc, self.scale, self.route.sdpa_min_queries,
                                         lambda q, t, n, s: self._kernel(q, _int32(t), _int32(n), _int32(s), k_cache,
                                                                         v_cache))
        return self._kernel(q, self.block_tables, self.context_lens, self.query_start_loc, k_cache, v_cache)

    def _kernel(self, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The C++ kernel over int32, contiguous metadata (build's, or the SDPA path's remainder converted)."""
        r = self.route
        return kernels.load().paged_attention(q, k_cache, v_cache, tables, lens, starts, self.scale,
                                              self.max_query_len, r.tile_min_rows, r.few_tile_min_rows, r.tile_pairs,
                                              r.tile_f16)


def is_fast_path_available() -> bool:
    """Whether the C++ kernel is usable; compiles (or loads the cached build of) it on the first call."""
    return kernels.load() is not None


def _reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Per sequence: gather its blocks into contiguous K/V, masked softmax in fp32. Slow, obviously right."""
    block_size, num_kv_heads, head_dim = *k_cache.shape[1:3], q.shape[-1]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    for s, ctx in enumerate(lens):
        begin, end = starts[s], starts[s + 1]
        if end == begin:
            continue
        blocks = block_tables[s, : math.ceil(ctx / block_size)].long()
        k, v = (_rows(cache[blocks].reshape(-1, *cache.shape[2:])[:ctx], head_dim) for cache in (k_cache, v_cache))
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [ctx, H, D]
        scores = torch.einsum("qhd,khd->hqk", q[begin:end].float(), k) * scale
        q_pos = torch.arange(ctx - (end - begin), ctx).unsqueeze(1)
        scores.masked_fill_(torch.arange(ctx).unsqueeze(0) > q_pos, float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def _rows(cache_rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cache rows as fp32 ``[..., head_dim]`` (int8 records dequantised)."""
    return dequantize_kv(cache_rows, head_dim) if cache_rows.dtype == torch.uint8 else cache_rows.float()


def cpp_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                  route: AttentionRoute) -> torch.Tensor:
    """The C++ kernel; ``route`` picks the kernel per sequence (tests and the dispatch force either one), and sends
    long bf16 prompt chunks to torch's flash attention where it measured faster (attention_sdpa.py)."""
    step = StepAttention.build(q.dtype, q.shape[-1], k_cache, block_tables, context_lens, query_start_loc, scale,
                               max_query_len, "cpp", route)
    return step(q, k_cache, v_cache)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _pick_backend(dtype: torch.dtype, head_dim: int, k_cache: torch.Tensor) -> str:
    """``"cpp"`` when the kernel handles these inputs and built; else ``"reference"``, warning once per reason."""
    reason = unsupported_reason(dtype, head_dim, k_cache)
    if not reason and not is_fast_path_available():
        reason = f"kernel build failed: {(kernels.build_error() or '').splitlines()[0]}"
    if not reason:
        return "cpp"
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"pagedllm: using the slow reference attention ({reason})", RuntimeWarning, stacklevel=4)
    return "reference"


def unsupported_reason(dtype: torch.dtype, head_dim: int, k_cache: torch.Tensor) -> str:
    """Why the C++ kernel cannot attend queries of this dtype and head_dim over this cache ("" if it can)."""
    ok_dtypes = (torch.float32, torch.bfloat16)
    if dtype not in ok_dtypes or k_cache.dtype not in (*ok_dtypes, torch.uint8):
        return f"dtypes {dtype}/{k_cache.dtype} are not float32/bfloat16 (the cache: or int8 records)"
    if head_dim % 16:
        return f"head_dim {head_dim} is not a multiple of 16"
    if not k_cache.is_contiguous():
        return "the KV cache is not contiguous"
    return ""
