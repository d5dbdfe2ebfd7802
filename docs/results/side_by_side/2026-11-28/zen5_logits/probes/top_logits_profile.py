"""torch.profiler over the greedy logits pass (`LlamaModel.top_logits`) of the default model, 64 and 256 random hidden
rows, five calls each; the C++ kernels do not show (they are not aten ops), the glue around them does:
    PYTHONPATH=TREE python top_logits_profile.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm.entrypoints.llm import LLM

model = LLM(kv_cache_memory="256MiB").engine.runner.model
torch.set_num_threads(2)
for rows in (64, 256):
    hidden = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    for _ in range(3):
        model.top_logits(hidden)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        model.top_logits(hidden)
        best = min(best, time.perf_counter() - start)
    print(f"{rows} rows: top_logits {best * 1e3:.2f} ms (best of 10)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            model.top_logits(hidden)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
