"""Decode attention over a bf16 paged KV cache: the C++ kernel's time and effective read bandwidth.

Per shape (batch x context), 30 layers' worth of cache in shuffled blocks of 16 tokens (so that it comes from
memory, not from the last-level cache), the default model's heads (9 query, 3 kv, 64 wide), one decode query per
sequence (bf16 queries, or `--q-dtype float32`: a model run in fp32 over a bf16 cache). Prints the best of `--reps`
passes over the 30 layers, and the K/V bytes read divided by that time. The shapes: a full decode batch (193 x 300),
mid-size ones, and the tail of a run (1-2 long sequences, where the kernel splits each context into partitions
across threads).

    python docs/scripts/decode_attention_speed.py            # the checkout on PYTHONPATH
    PYTHONPATH=/work/main python docs/scripts/decode_attention_speed.py   # another checkout's kernel
    python docs/scripts/decode_attention_speed.py --q-dtype float32      # fp32 queries, bf16 cache
    python docs/scripts/decode_attention_speed.py --q-dtype float32 --cache-dtype float32   # an fp32 model's own cache

Timings on a shared machine are noisy: compare two checkouts by alternating runs, several times.
"""

from __future__ import annotations

import argparse
import time

import torch
from kv_int8_attention import HEAD_DIM, KV_HEADS, LAYERS, layer  # this folder: the same cache, bf16 here

import pagedllm
from pagedllm.model.attention import paged_attention

SHAPES = [(193, 300), (64, 512), (8, 1024), (2, 1200), (1, 1200)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="passes over the 30 layers per shape (best is kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES),
                        help="comma-separated batch x context, e.g. 2x1200,1x1200")
    parser.add_argument("--q-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the queries' dtype (and the output's)")
    parser.add_argument("--cache-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the cache's dtype (float32: the bf16 values widened, the same numbers)")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    q_dtype, cache_dtype = getattr(torch, args.q_dtype), getattr(torch, args.cache_dtype)
    print(f"pagedllm from {pagedllm.__file__}, {args.threads} threads, best of {args.reps}, {q_dtype} queries, "
          f"{cache_dtype} cache")
    print(f"| {'batch x context':<15} | {'ms (30 layers)':>14} | {'effective KV read':>17} |")
    print(f"|{'-' * 17}|{'-' * 16}|{'-' * 19}|")
    for batch, ctx in shapes:
        layers = [layer(batch, ctx, False, gen) for _ in range(LAYERS)]
        layers = [(a[0].to(q_dtype), a[1].to(cache_dtype), a[2].to(cache_dtype), *a[3:]) for a in layers]
        for a in layers[:2]:
            paged_attention(*a, backend="cpp")  # the first call builds or loads the kernel
        best = float("inf")
        for _ in range(args.reps):
            start = time.perf_counter()
            for a in layers:
                paged_attention(*a, backend="cpp")
            best = min(best, time.perf_counter() - start)
        kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * cache_dtype.itemsize * LAYERS  # K and V
        print(f"| {f'{batch} x {ctx}':<15} | {best * 1e3:>14.1f} | {kv_bytes / best / 1e9:>12.1f} GB/s |", flush=True)
        del layers


if __name__ == "__main__":
    main()
