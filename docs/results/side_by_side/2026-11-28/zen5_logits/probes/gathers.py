"""Advanced indexing against index_select for the logits pass's gathers (a [49,152, 576] bf16 weight), best of 30, ms:
    python gathers.py
"""

import timeit

import torch

torch.set_num_threads(2)


def best_ms(fn) -> float:
    return min(timeit.repeat(fn, number=1, repeat=30)) * 1e3


W = torch.randn(49152, 576).bfloat16()
Wt = W.t().contiguous()
for rows in (64, 256):
    ids, ch = torch.randint(0, 49152, (rows, 16)), torch.randperm(576)[:16]
    print(f"{rows} rows: W[ids] {best_ms(lambda ids=ids: W[ids]):.3f}, "
          f"W.index_select {best_ms(lambda ids=ids: W.index_select(0, ids.flatten())):.3f}; "
          f"Wt[channels] {best_ms(lambda ch=ch: Wt[ch]):.3f}, "
          f"Wt.index_select {best_ms(lambda ch=ch: Wt.index_select(0, ch)):.3f}")
