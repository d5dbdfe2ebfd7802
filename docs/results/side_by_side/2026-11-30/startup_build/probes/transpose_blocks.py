"""plain.t().contiguous() of a 49,152 x 576 fp32 matrix in one call, and copied 128 / 256 / 512 / 2,048 rows at a time
(layers.transposed uses 256), inside heap.build_in_heap; seconds per copy, four rounds."""
import time

import torch

from pagedllm.model import heap
from pagedllm.model.weight_forms import transposed

torch.set_num_threads(2)
with heap.build_in_heap():
    w = torch.randn(49152, 576)
    reference = w.t().contiguous()
    for _ in range(4):
        times = []
        start = time.perf_counter()
        whole = w.t().contiguous()
        times.append(time.perf_counter() - start)
        del whole
        for rows in (128, 256, 512, 2048):
            start = time.perf_counter()
            blocked = transposed(w, rows)
            times.append(time.perf_counter() - start)
            assert torch.equal(blocked, reference)
            del blocked
        print("one call, 128, 256, 512, 2048 rows:", " ".join(f"{t:.3f}" for t in times))
