"""The default model's load: seconds in q4_values (the dense fp32 values of each 4-bit matrix) by kind, against
the whole load."""
import time

import torch

from pagedllm.model.loader import default_model_path
from pagedllm.model.loader import gguf as g

torch.set_num_threads(2)
spent = {}
orig = g.q4_values


def timed(q, d, m):
    s = time.perf_counter()
    out = orig(q, d, m)
    spent[q.shape] = spent.get(q.shape, 0) + time.perf_counter() - s
    return out


g.q4_values = timed
for _ in range(3):
    spent.clear()
    s = time.perf_counter()
    loaded = g.load_gguf(default_model_path(), torch.float32, keep_4bit=True)
    total = time.perf_counter() - s
    types = {}
    print(f"load {total:.3f} s; q4_values {sum(spent.values()):.3f} s:",
          ", ".join(f"{tuple(k)} {v:.3f}" for k, v in spent.items()))
    del loaded
