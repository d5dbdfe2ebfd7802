"""A decode step of BATCH sequences (~300 tokens of context, no drafts), the greedy logits pass's fp32 rescoring as
before (a gather, an einsum and eight torch ops) against rescore_top_k (one C++ pass), alternating step by step in
one engine (ABBA order); median and best of STEPS (default 40) each:
    python steps_rescore_ab.py 1 4 16 64 200
"""
import os
import random
import statistics
import sys
import time
import types

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.llama import RESCORE_TOP_K

engine = LLM(kv_cache_memory="6GiB", num_speculative_tokens=0, max_num_seqs=256).engine
model = engine.runner.model


def before(self, hidden, grammar=None):
    logits = self._scratch_logits(hidden)
    values, ids, lse = self.ext.top_k_logsumexp(logits, min(RESCORE_TOP_K, logits.shape[-1]))
    rows = self.lm_head.index_select(0, ids.reshape(-1)).view(*ids.shape, -1)
    exact = torch.einsum("sd,skd->sk", hidden.float(), rows.float())
    exact = exact.masked_fill_(values == float("-inf"), float("-inf"))
    rest = (1 - (values - lse[:, None]).exp().sum(-1)).clamp_min(0)
    lse = lse + (rest + (exact - lse[:, None]).exp().sum(-1)).log()
    return exact, ids, lse


STEPS = int(os.environ.get("STEPS", "40"))  # steps of each side per batch
sides = {"now": None, "before": types.MethodType(before, model)}
rng = random.Random(0)
print("| batch | now ms (median, best) | before ms (median, best) | now / before (medians) |")
print("|---:|---:|---:|---:|")
for batch in map(int, sys.argv[1:]):
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", [rng.randrange(100, 40000) for _ in range(300)],
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    while engine.scheduler.waiting or not all(g.is_decoding for g in engine.scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()
    times = {side: [] for side in sides}
    for n in range(STEPS):
        for side, fn in (sides.items() if n % 2 == 0 else reversed(sides.items())):
            model.__dict__.pop("top_logits", None)
            if fn is not None:
                model.top_logits = fn
            start = time.perf_counter()
            engine.step()
            times[side].append(time.perf_counter() - start)
    model.__dict__.pop("top_logits", None)
    med = {s: statistics.median(t) * 1e3 for s, t in times.items()}
    best = {s: min(t) * 1e3 for s, t in times.items()}
    print(f"| {batch} | {med['now']:.2f}, {best['now']:.2f} | {med['before']:.2f}, {best['before']:.2f} | "
          f"{med['now'] / med['before']:.3f} |", flush=True)
    for request_id in list(engine.groups):
        engine.abort_request(request_id)
