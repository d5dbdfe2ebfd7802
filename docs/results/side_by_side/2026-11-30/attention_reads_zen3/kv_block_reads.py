"""(The AVX2 port of 2026-11-28/zen5_logits/attention_reads/: 8-float loads, for CPUs without AVX-512.)
What reading a decode step's K/V blocks can reach here, with no arithmetic but a sum (kv_block_reads.cpp, built
beside this file): 30 layers of 64 sequences x 320 tokens in shuffled blocks of 16 tokens x 384 bytes (the default
model's 3 kv heads x 64 bf16) for K and for V, 2 threads claiming sequences, against torch's sum over the same bytes
in order. Modes: 0 each block's K then its V, line by line, no prefetch; 1 K and V line by line interleaved, no
prefetch (dist > 0: the whole block `dist` ahead prefetched at once); 2 interleaved, each line's twin `dist` blocks
ahead prefetched (T1) along the way; 3 the same for every 8th line only; 5 the decode kernel's order (8 tokens at a
time, head by head). Pools on 4 KB pages, then with MADV_HUGEPAGE (as the engine's KV pool, model/prefault.py).
    python kv_block_reads.py
"""

import mmap
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ext = load("kv_block_reads", [str(Path(__file__).with_name("kv_block_reads.cpp"))],
           extra_cflags=["-O3", "-march=native"], extra_ldflags=["-lpthread"], verbose=False)
torch.set_num_threads(2)
LAYERS, SEQS, BLOCKS, BLOCK_BYTES = 30, 64, 20, 16 * 384
keep = []


def pool(huge: bool) -> torch.Tensor:
    m = mmap.mmap(-1, SEQS * BLOCKS * BLOCK_BYTES)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    keep.append(m)
    return torch.frombuffer(m, dtype=torch.float32).fill_(1.0)


def best(fn, runs: int = 5) -> float:
    return min(fn() for _ in range(runs))


def torch_sum(ks, vs) -> float:
    start = time.perf_counter()
    for k, v in zip(ks, vs, strict=True):
        k.sum(), v.sum()
    return time.perf_counter() - start


gen = torch.Generator().manual_seed(0)
tables = torch.stack([torch.randperm(SEQS * BLOCKS, generator=gen).view(SEQS, BLOCKS).int()
                      for _ in range(LAYERS)]).contiguous()
nbytes = 2 * LAYERS * SEQS * BLOCKS * BLOCK_BYTES


def measure(huge: bool) -> None:
    ks, vs = [pool(huge) for _ in range(LAYERS)], [pool(huge) for _ in range(LAYERS)]
    in_order = nbytes / best(lambda: torch_sum(ks, vs)) / 1e9
    print(f"{'2 MB' if huge else '4 KB'} pages: torch sum in order {in_order:.1f} GB/s")
    for mode, dist in ((0, 0), (1, 0), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2), (5, 0)):
        def read(mode: int = mode, dist: int = dist) -> float:
            return ext.run(ks, vs, tables, BLOCK_BYTES, mode, dist, 1, 2)
        gbs = [nbytes / best(read) / 1e9 for _ in range(2)]
        print(f"  mode {mode} dist {dist}: {gbs[0]:.1f}, {gbs[1]:.1f} GB/s", flush=True)


for huge in (False, True):
    measure(huge)
