"""Each layer kind's matmuls per path, timed inside a step's order (all 120 layer matmuls, layer by layer, so each
weight comes from wherever a real step finds it: memory, where the model is bigger than the last-level cache),
against the dispatch's own timing (`pagedllm bench kernels`: 8 layers' weights of one kind in turn). Per kind and
path, the median over ROUNDS passes of the kind's 30 calls, us per call:
    PAGEDLLM_KERNEL=static python docs/scripts/step_order_paths.py 16 64 128 256
(PAGEDLLM_KERNEL=static keeps every form a weight has; the measured routes drop the ones they do not use.)
"""

import os
import statistics
import sys
import time

import torch

from pagedllm import LLM

assert os.environ.get("PAGEDLLM_KERNEL") == "static", "run with PAGEDLLM_KERNEL=static (every form kept)"
KINDS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
PATHS = ("int4", "bf16_gemm", "onednn")
ROUNDS = 9
llm = LLM(kv_cache_memory="256MiB")
layers = llm.engine.runner.model.layers
dtype = llm.engine.runner.model.dtype  # the activations' dtype: bfloat16, or float32 on CPUs without fast bf16
PATHS = tuple(p for p in PATHS if p in layers[0].qkv_weight.paths())  # no bf16_gemm form in an fp32 model


def step_pass(path: str, xs: dict[str, torch.Tensor], spent: dict[str, list[float]]) -> None:
    """One step's 120 matmuls on `path`, each kind's total time appended to spent[kind] (us per call)."""
    total = dict.fromkeys(KINDS, 0.0)
    for layer in layers:
        for kind in KINDS:
            weight = getattr(layer, kind)
            start = time.perf_counter()
            weight.mm(xs[kind], path=path)
            total[kind] += time.perf_counter() - start
    for kind in KINDS:
        spent[kind].append(total[kind] / len(layers) * 1e6)


with torch.inference_mode():
    for rows in map(int, sys.argv[1:] or ["64"]):
        xs = {kind: torch.randn(rows, getattr(layers[0], kind).shape[1]).to(dtype) for kind in KINDS}
        spent = {path: {kind: [] for kind in KINDS} for path in PATHS}
        for _ in range(ROUNDS):
            for path in PATHS:  # interleaved, so a neighbour's load falls on every path alike
                step_pass(path, xs, spent[path])
        for kind in KINDS:
            cells = {path: statistics.median(spent[path][kind][1:]) for path in PATHS}
            best = min(cells, key=cells.get)
            print(f"rows {rows:4d} {kind.removesuffix('_weight'):8s} "
                  + "  ".join(f"{p} {t:7.0f}" for p, t in cells.items()) + f"  -> {best}")
