"""Attention over the paged KV cache: the cache write, a readable reference and a fast C++ kernel.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. A step's
queries are flat (``[T, num_heads, head_dim]``, decodes and prompt chunks mixed, no padding); sequence ``s``
owns ``q[query_start_loc[s]:query_start_loc[s+1]]``, which are the last tokens of its context.

Backends: ``"reference"`` gathers each sequence's blocks and runs a masked softmax in fp32 (the oracle of the
tests); ``"cpp"`` runs ``csrc/paged_attention.cpp``, compiled once per source version into the torch
extensions cache on first use; ``"auto"`` takes the kernel when it compiled and otherwise the reference, with
one warning. ``pagedllm bench attention`` (pagedllm/bench_latency.py) times them against each other and against
the same kernel over consecutive blocks and SDPA over a dense cache.
"""

from __future__ import annotations

import math
import warnings

import torch

from pagedllm.model import kernels

# A sequence whose step has at least this many query rows (queries x query heads per kv head) uses the tiled
# prefill kernel, fewer the row (decode) kernel; measured crossover on this CPU.
_TILE_MIN_ROWS = 20

_warned: set[str] = set()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys/values ``[T, num_kv_heads, head_dim]`` at their cache slots, in place.

    ``slot_mapping[i] = block_id * block_size + offset`` (int64, or int32, converted). One vectorised copy.
    """
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    backend: str = "auto") -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached context; returns ``q``'s shape and dtype.

    Query ``i`` of a sequence with ``n`` queries and ``context_lens[s]`` cached tokens (this step's included)
    sits at position ``context_lens[s] - n + i`` and sees key positions ``0 ..`` that position.
    """
    if backend == "auto":
        backend = _pick_backend(q, k_cache)
    if backend == "reference":
        return _reference_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    if backend == "cpp":
        return _cpp_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                              max_query_len, _TILE_MIN_ROWS)
    raise ValueError(f"unknown attention backend {backend!r}; expected 'auto', 'reference' or 'cpp'")


def is_fast_path_available() -> bool:
    """Whether the C++ kernel is usable; compiles (or loads the cached build of) it on the first call."""
    return kernels.load() is not None


def _reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Per sequence: gather its blocks into contiguous K/V, masked softmax in fp32. Slow, obviously right."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    for s, ctx in enumerate(lens):
        begin, end = starts[s], starts[s + 1]
        if end == begin:
            continue
        blocks = block_tables[s, : math.ceil(ctx / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [ctx, H, D]
        scores = torch.einsum("qhd,khd->hqk", q[begin:end].float(), k) * scale
        q_pos = torch.arange(ctx - (end - begin), ctx).unsqueeze(1)
        scores.masked_fill_(torch.arange(ctx).unsqueeze(0) > q_pos, float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def _cpp_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                   tile_min_rows: int) -> torch.Tensor:
    """The C++ kernel; ``tile_min_rows`` picks the kernel per sequence (tests force either one)."""
    ext = kernels.load()
    if ext is None:
        raise RuntimeError(f"pagedllm attention kernel failed to build: {kernels.build_error()}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    return ext.paged_attention(q, k_cache, v_cache, _int32(block_tables), _int32(context_lens),
                               _int32(query_start_loc), float(scale), int(max_query_len), int(tile_min_rows))


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _pick_backend(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """``"cpp"`` when the kernel handles these inputs and built; else ``"reference"``, warning once per reason."""
    reason = _unsupported_reason(q, k_cache)
    if not reason and not is_fast_path_available():
        reason = f"kernel build failed: {(kernels.build_error() or '').splitlines()[0]}"
    if not reason:
        return "cpp"
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"pagedllm: using the slow reference attention ({reason})", RuntimeWarning, stacklevel=3)
    return "reference"


def _unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    ok_dtypes = (torch.float32, torch.bfloat16)
    if q.dtype not in ok_dtypes or k_cache.dtype not in ok_dtypes:
        return f"dtypes {q.dtype}/{k_cache.dtype} are not float32/bfloat16"
    if q.shape[-1] % 16:
        return f"head_dim {q.shape[-1]} is not a multiple of 16"
    if not k_cache.is_contiguous():
        return "the KV cache is not contiguous"
    return ""
