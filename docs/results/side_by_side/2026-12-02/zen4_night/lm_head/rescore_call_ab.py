"""The greedy logits pass's rescoring in a built engine, as before (a gather, an einsum and eight torch ops) against
rescore_top_k (one C++ pass), and the whole pass (top_logits) with each, at 1, 16, 64 and 200 rows: medians of 30,
interleaved, a 64 MB write before each call to evict the caches as a step's other weights do.
    python rescore_call_ab.py
"""
# ruff: noqa: B023 (each iteration's lambdas are called within it)
import statistics
import time

import torch

from pagedllm import LLM
from pagedllm.model.llama import RESCORE_TOP_K

engine = LLM(kv_cache_memory="1GiB", num_speculative_tokens=0).engine
model = engine.runner.model
evict = torch.empty(64 << 20, dtype=torch.uint8)


def rescore_before(hidden, values, ids, lse):
    rows = model.lm_head.index_select(0, ids.reshape(-1)).view(*ids.shape, -1)
    exact = torch.einsum("sd,skd->sk", hidden.float(), rows.float())
    exact = exact.masked_fill_(values == float("-inf"), float("-inf"))
    rest = (1 - (values - lse[:, None]).exp().sum(-1)).clamp_min(0)
    return exact, lse + (rest + (exact - lse[:, None]).exp().sum(-1)).log()


def top_logits_before(hidden):
    logits = model._scratch_logits(hidden)
    values, ids, lse = model.ext.top_k_logsumexp(logits, RESCORE_TOP_K)
    exact, lse = rescore_before(hidden, values, ids, lse)
    return exact, ids, lse


print("| rows | rescoring before ms | now ms | top_logits before ms | now ms | max abs diff (exact, lse) |")
print("|---:|---:|---:|---:|---:|---|")
for rows in (1, 16, 64, 200):
    hidden = torch.randn(rows, 576).to(model.lm_head.dtype)
    values, ids, lse = model.ext.top_k_logsumexp(model._scratch_logits(hidden), RESCORE_TOP_K)
    calls = {
        "rescore before": lambda: rescore_before(hidden, values, ids, lse),
        "rescore now": lambda: model.ext.rescore_top_k(hidden, model.lm_head, values, ids, lse),
        "pass before": lambda: top_logits_before(hidden),
        "pass now": lambda: model.top_logits(hidden),
    }
    ts = {k: [] for k in calls}
    for _ in range(30):
        for k, f in calls.items():
            evict.add_(1)
            start = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - start)
    m = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
    old = rescore_before(hidden, values, ids, lse)
    new = model.ext.rescore_top_k(hidden, model.lm_head, values, ids, lse)
    diff = ", ".join(f"{(a - b).abs().max().item():.1e}" for a, b in zip(old, new))
    print(f"| {rows} | {m['rescore before']:.3f} | {m['rescore now']:.3f} | {m['pass before']:.3f} | "
          f"{m['pass now']:.3f} | {diff} |", flush=True)
