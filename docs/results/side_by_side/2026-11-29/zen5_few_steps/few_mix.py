"""Row vs tiled attention kernel over a mix of steps of few sequences (1, 3 and 6 sequences), the dispatch's own
timing (model/attention_dispatch.py), 9/3 heads x 64, bf16 over a bf16 cache, 2 threads. Per query count: the sums
over the three steps, their ratio, then each step's ratio."""

import torch

from pagedllm.model.attention import AttentionRoute
from pagedllm.model.attention_dispatch import AttentionShape, _Step, time_call, time_kernels

torch.set_num_threads(2)
shape = AttentionShape(9, 3, 64, torch.bfloat16, torch.bfloat16, 16)
gen = torch.Generator().manual_seed(0)
routes = {"rows": AttentionRoute(1 << 30, 1 << 30, True), "tile": AttentionRoute(1, 1, True)}
for lo, hi in ((100, 1000), (300, 1500)):
    steps = {n: _Step.build(shape, torch.randint(lo, hi + 1, (n,), generator=gen).tolist(), gen) for n in (1, 3, 6)}
    print("contexts", lo, hi)
    for q in (1, 2, 3, 4, 5, 6, 8, 12, 16):
        total = {"rows": 0.0, "tile": 0.0}
        per = []
        for n, step in steps.items():
            with torch.inference_mode():
                best = time_kernels({k: step.runs(q, r, gen) for k, r in routes.items()}, "few", q * 3, time_call)
            per.append(f"S{n} {best['tile'] / best['rows']:.2f}")
            for k in total:
                total[k] += best[k]
        print(q, q * 3, round(total["rows"] * 1e6), round(total["tile"] * 1e6),
              round(total["tile"] / total["rows"], 2), *per, flush=True)
