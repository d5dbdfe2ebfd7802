"""SamplingBatch.build's time per call: 1 and 64 greedy rows, 64 rows at temperature 0.8 / top_p 0.95 (no penalties,
no logprobs). Usage: PYTHONPATH=TREE python sampling_batch_build.py"""
import time

import torch

from pagedllm.model.sampler import SamplingBatch
from pagedllm.sampling_params import SamplingParams

torch.set_num_threads(2)
for S, p in ((1, SamplingParams(temperature=0.0)), (64, SamplingParams(temperature=0.0)),
             (64, SamplingParams(temperature=0.8, top_p=0.95))):
    params, prompts, outs, gens = [p] * S, [[1, 2, 3]] * S, [[4, 5]] * S, [None] * S
    for _ in range(200):
        SamplingBatch.build(params, prompts, outs, gens, 49152, eos_token_ids=(2,))
    start = time.perf_counter()
    for _ in range(2000):
        SamplingBatch.build(params, prompts, outs, gens, 49152, eos_token_ids=(2,))
    print(f"{S} rows, temperature {p.temperature}: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us")
