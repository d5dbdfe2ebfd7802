"""Attention over the paged KV cache: the cache write, a readable reference and a fast C++ kernel.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. A step's
queries are flat (``[T, num_heads, head_dim]``, decodes and prompt chunks mixed, no padding); sequence ``s``
owns ``q[query_start_loc[s]:query_start_loc[s+1]]``, which are the last tokens of its context.

Backends: ``"reference"`` gathers each sequence's blocks and runs a masked softmax in fp32 (the oracle of the
tests); ``"cpp"`` runs ``csrc/paged_attention.cpp``, compiled once per source version into the torch
extensions cache on first use; ``"auto"`` takes the kernel when it compiled and otherwise the reference, with
one warning. Run ``python -m pagedllm.attention`` for a benchmark table.
"""

from __future__ import annotations

import hashlib
import math
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
# Sequences with at least this many queries in a step use the tiled (prefill) kernel, fewer the row kernel.
_TILE_MIN_QUERIES = 4

_lock = threading.Lock()
_ext: ModuleType | None = None
_ext_error: str | None = None
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
        backend = "cpp" if _kernel_supports(q, k_cache) and is_fast_path_available() else "reference"
        if backend == "reference":
            _warn_once("auto", f"pagedllm: fast attention kernel unavailable ({_why_not(q, k_cache)}); "
                       "using the slow reference path")
    if backend == "reference":
        return _reference_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    if backend == "cpp":
        return _cpp_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                              max_query_len, _TILE_MIN_QUERIES)
    raise ValueError(f"unknown attention backend {backend!r}; expected 'auto', 'reference' or 'cpp'")


def is_fast_path_available() -> bool:
    """Whether the C++ kernel is usable; compiles (or loads the cached build of) it on the first call."""
    return _load_extension() is not None


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
                   tile_min_queries: int) -> torch.Tensor:
    """The C++ kernel; ``tile_min_queries`` picks the kernel per sequence (tests force either one)."""
    ext = _load_extension()
    if ext is None:
        raise RuntimeError(f"pagedllm attention kernel failed to build: {_ext_error}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    return ext.paged_attention(q, k_cache, v_cache, _int32(block_tables), _int32(context_lens),
                               _int32(query_start_loc), float(scale), int(max_query_len), int(tile_min_queries))


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _kernel_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return _why_not(q, k_cache) == ""


def _why_not(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    ok_dtypes = (torch.float32, torch.bfloat16)
    if q.dtype not in ok_dtypes or k_cache.dtype not in ok_dtypes:
        return f"dtypes {q.dtype}/{k_cache.dtype} not float32/bfloat16"
    if q.shape[-1] % 16:
        return f"head_dim {q.shape[-1]} is not a multiple of 16"
    if not k_cache.is_contiguous():
        return "KV cache is not contiguous"
    if _ext is None and _ext_error is not None:
        return f"build failed: {_ext_error.splitlines()[0] if _ext_error else ''}"
    return ""


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _load_extension() -> ModuleType | None:
    """JIT-build the kernel once per source version (cached on disk by torch, so later processes just load)."""
    global _ext, _ext_error
    if _ext is not None or _ext_error is not None:
        return _ext
    with _lock:
        if _ext is None and _ext_error is None:
            try:
                from torch.utils.cpp_extension import load

                digest = hashlib.sha256(_SOURCE.read_bytes() + repr(_CFLAGS).encode()).hexdigest()[:16]
                _ext = load(name=f"pagedllm_attention_{digest}", sources=[str(_SOURCE)],
                            extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, verbose=False)
            except Exception as exc:  # no compiler, no ninja, bad flags: the reference path still works
                _ext_error = f"{type(exc).__name__}: {exc}"
                _warn_once("build", f"pagedllm: could not build the attention kernel, using the reference "
                           f"path ({_ext_error.splitlines()[0]})")
    return _ext


def bench_attention(num_threads: int = 2, repeats: int = 20) -> None:
    """Print decode/prefill timings of the kernel against the reference and contiguous-cache SDPA.

    Decode: 32 sequences, context ~U(100, 1000), block 16, blocks in random order; four layers' caches are
    used in turn so that the KV cache is cold, as in a real forward pass.
    """
    import statistics
    import time

    import torch.nn.functional as F

    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(0)

    def timed(fn, n: int) -> float:
        fn(0)
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def paged(lens: list[int], kvh: int, d: int, dtype: torch.dtype, block: int = 16):
        nblocks = [math.ceil(n / block) for n in lens]
        perm = torch.randperm(sum(nblocks), generator=gen)
        tables = torch.zeros(len(lens), max(nblocks), dtype=torch.int32)
        for s, chunk in enumerate(perm.split(nblocks)):
            tables[s, : len(chunk)] = chunk
        caches = [torch.randn(sum(nblocks), block, kvh, d, generator=gen).to(dtype) for _ in range(8)]
        return tables, caches

    print(f"threads={num_threads}  (median ms per layer call)")
    print(f"{'case':<34}{'dtype':>6}{'cpp':>9}{'reference':>11}{'contig SDPA':>13}{'cpp/SDPA':>10}")
    for heads, kvh in [(9, 3), (12, 12)]:
        lens = torch.randint(100, 1001, (32,), generator=gen).tolist()
        for dtype in (torch.float32, torch.bfloat16):
            tables, caches = paged(lens, kvh, 64, dtype)
            q = torch.randn(32, heads, 64, generator=gen).to(dtype)
            ctx = torch.tensor(lens, dtype=torch.int32)
            qsl = torch.arange(33, dtype=torch.int32)
            lmax = max(lens)
            kc = [torch.randn(32, kvh, lmax, 64, generator=gen).to(dtype) for _ in range(4)]
            mask = (torch.arange(lmax)[None, :] < ctx[:, None]).view(32, 1, 1, lmax)

            def run(i: int, backend: str) -> None:
                paged_attention(q, caches[2 * (i % 4)], caches[2 * (i % 4) + 1], tables, ctx, qsl, 0.125, 1,
                                backend)

            cpp = timed(lambda i: run(i, "cpp"), repeats)
            ref = timed(lambda i: run(i, "reference"), max(3, repeats // 5))
            sdpa = timed(lambda i: F.scaled_dot_product_attention(
                q.view(32, heads, 1, 64), kc[i % 4], kc[(i + 1) % 4], attn_mask=mask, enable_gqa=True), repeats)
            name = f"decode 32 seqs {heads}/{kvh}x64 ctx~U(100,1000)"
            print(f"{name:<34}{str(dtype)[6:]:>6}{cpp:>9.2f}{ref:>11.2f}{sdpa:>13.2f}{cpp / sdpa:>10.2f}")
    for heads, kvh in [(9, 3), (12, 12)]:
        for n in (512, 2048):
            for dtype in (torch.float32, torch.bfloat16):
                tables, caches = paged([n], kvh, 64, dtype)
                q = torch.randn(n, heads, 64, generator=gen).to(dtype)
                ctx = torch.tensor([n], dtype=torch.int32)
                qsl = torch.tensor([0, n], dtype=torch.int32)
                qc = q.transpose(0, 1).unsqueeze(0)
                kc = torch.randn(1, kvh, n, 64, generator=gen).to(dtype)

                def run(i: int, backend: str) -> None:
                    paged_attention(q, caches[0], caches[1], tables, ctx, qsl, 0.125, n, backend)

                reps = max(3, repeats // (n // 256))
                cpp = timed(lambda i: run(i, "cpp"), reps)
                ref = timed(lambda i: run(i, "reference"), 3)
                sdpa = timed(lambda i: F.scaled_dot_product_attention(qc, kc, kc, is_causal=True, enable_gqa=True),
                             reps)
                name = f"prefill {n} tokens {heads}/{kvh}x64"
                print(f"{name:<34}{str(dtype)[6:]:>6}{cpp:>9.2f}{ref:>11.2f}{sdpa:>13.2f}{cpp / sdpa:>10.2f}")


if __name__ == "__main__":
    bench_attention()
