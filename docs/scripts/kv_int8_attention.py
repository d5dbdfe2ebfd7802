"""Decode attention over a bf16 and an int8 KV cache (--kv-cache-dtype), the C++ kernel, 30 layers' worth of cache
(so that it comes from memory, not from the last-level cache), the default model's heads (9 query, 3 kv, 64 wide).

    python docs/scripts/kv_int8_attention.py
"""

from __future__ import annotations

import time

import torch

from pagedllm.model.attention import kv_record_len, paged_attention, write_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def layer(batch: int, ctx: int, int8: bool, gen: torch.Generator) -> tuple:
    """One layer's cache holding `batch` sequences of `ctx` tokens in shuffled blocks, and one decode query each."""
    per_seq = -(-ctx // BLOCK)
    row = kv_record_len(HEAD_DIM) if int8 else HEAD_DIM
    shape = (batch * per_seq, BLOCK, KV_HEADS, row)
    dtype = torch.uint8 if int8 else torch.bfloat16
    k_cache, v_cache = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).int()
    pos = torch.arange(ctx)
    slots = (tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).flatten()
    k, v = (torch.randn(batch * ctx, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for _ in range(2))
    write_kv(k, v, k_cache, v_cache, slots)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).bfloat16()
    return (q, k_cache, v_cache, tables, torch.full((batch,), ctx, dtype=torch.int32),
            torch.arange(batch + 1, dtype=torch.int32), HEAD_DIM ** -0.5, 1)


def main() -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    print(f"{'batch x context':<16} {'bf16 ms':>8} {'int8 ms':>8}  (30 layers, best of 3)")
    for batch, ctx in [(64, 512), (128, 256), (8, 1024), (32, 2048)]:
        times = {}
        for int8 in (False, True):
            layers = [layer(batch, ctx, int8, gen) for _ in range(LAYERS)]
            best = float("inf")
            for _ in range(4):
                t = time.perf_counter()
                for args in layers:
                    paged_attention(*args, backend="cpp")
                best = min(best, time.perf_counter() - t)
            times[int8] = best * 1e3
            del layers
        print(f"{batch:>5} x {ctx:<8} {times[False]:>8.1f} {times[True]:>8.1f}")


if __name__ == "__main__":
    main()
