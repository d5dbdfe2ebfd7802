"""Seconds to load the default GGUF in fp32 and with its 4-bit forms kept (what the default engine loads), in one
fresh process (the first load pays the imports and the file's first reads)."""
import time

import torch

from pagedllm.model.loader import load_model

start = time.perf_counter()
load_model(None, torch.float32)
first = time.perf_counter() - start
start = time.perf_counter()
load_model(None, torch.float32, keep_4bit=True)
print(f"load fp32 {first:.2f} s (first in the process), with the 4-bit forms {time.perf_counter() - start:.2f} s")
