"""The attention route measured as a first version did: its step's keys and values in 2 copies only (not twice the L3),
busy contexts of 64-512 tokens, against the measuring as committed, alternated; the default model's shape.
usage: python warm_caches.py ROUNDS"""
import sys

import torch

from pagedllm.model import attention_dispatch as ad
from pagedllm.model import kernels

torch.set_num_threads(2)
kernels.load()
shape = ad.AttentionShape(9, 3, 64, torch.bfloat16, torch.bfloat16, 16)
committed = (ad.cold_bytes, ad.BUSY_CONTEXTS)
for _ in range(int(sys.argv[1])):
    for name, cold, contexts in (("warm, 2 copies, 64-512 tokens", lambda: 0, (64, 512)),
                                 ("as committed", *committed)):
        ad.cold_bytes, ad.BUSY_CONTEXTS = cold, contexts
        t = ad.measure(shape)
        busy = ", ".join(f"{r}: {a * 1e3:.3f}/{b * 1e3:.3f}" for r, a, b in zip(t.rows["busy"], t.times["busy"]["rows"],
                                                                                t.times["busy"]["tile"]))
        print(f"{name}: {t.summary()}\n  busy rows/tile ms: {busy}")
