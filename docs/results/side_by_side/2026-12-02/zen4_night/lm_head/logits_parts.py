"""The greedy logits pass of the default model in a built engine, part by part, at 1, 64 and 200 rows (medians of
20, the parts interleaved, a 64 MB write before each call to evict the caches as a step's other weights do):
top_logits whole; its lm_head matmul into the kept buffer (_scratch_logits, on the route's path); the top-k pass;
the fp32 rescoring of the 16 candidates; and the lm_head call with and without its outlier split, with the torch
ops the split ran before (picking the channels, selecting and zeroing them, gathering their weight rows).
    python logits_parts.py
"""
# ruff: noqa: B023 (each iteration's lambdas are called within it)
import statistics
import time

import torch

from pagedllm import LLM

engine = LLM(kv_cache_memory="1GiB", num_speculative_tokens=0).engine
model = engine.runner.model
head = model.lm_head_weight.int8
print("lm_head route:", model.lm_head_weight.route)
evict = torch.empty(64 << 20, dtype=torch.uint8)
for rows in (1, 64, 200):
    x = torch.randn(rows, 576).to(model.lm_head.dtype)
    x[:, 7] *= 20
    out = x.new_empty(rows, head.out_features)
    logits = model._scratch_logits(x)
    vals, ids, lse = model.ext.top_k_logsumexp(logits, 16)
    ch = x.abs().amax(dim=0).topk(16).indices
    q, scale = head.ext.quantize_rows_int8(x, 127)
    parts = {
        "top_logits": lambda: model.top_logits(x),
        "matmul": lambda: model._scratch_logits(x),
        "top-k pass": lambda: model.ext.top_k_logsumexp(logits, 16),
        "rescoring": lambda: model._exact_logits(x, ids),
        "call, split": lambda: head.mm(x, out=out),
        "call, no split": lambda: head.ext.int8_gemm(head.ext.quantize_rows_int8(x, 127)[0], head.packed, scale,
                                                     head.scale, None, out),
        "was: amax+topk": lambda: x.abs().amax(dim=0).topk(16).indices,
        "was: select+zero": lambda: (x.index_select(1, ch).float(), x.index_fill(1, ch, 0)),
        "was: gather rows": lambda: head.plain_t.index_select(0, ch),
    }
    ts = {k: [] for k in parts}
    for _ in range(20):
        for k, f in parts.items():
            evict.add_(1)
            start = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - start)
    print(f"{rows} rows: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in ts.items()) + " ms",
          flush=True)
