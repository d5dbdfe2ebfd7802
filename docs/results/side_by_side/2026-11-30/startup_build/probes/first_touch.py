"""A fresh 113 MB tensor's first write (its pages faulted in) against a second write to the same pages."""
import time

import torch

torch.set_num_threads(2)
for _ in range(3):
    start = time.perf_counter()
    a = torch.empty(28_311_552)
    a.fill_(1.0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    a.fill_(2.0)
    print(f"first touch {first:.4f} s, second write {time.perf_counter() - start:.4f} s")
    del a
