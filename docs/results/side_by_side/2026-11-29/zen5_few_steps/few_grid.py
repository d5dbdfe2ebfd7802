"""Row vs tiled attention kernel in steps of few sequences, one step at a time: S sequences x context x queries,
the dispatch's own timing (model/attention_dispatch.py), 9/3 heads x 64, bf16 over a bf16 cache, 2 threads."""

import torch

from pagedllm.model.attention import AttentionRoute
from pagedllm.model.attention_dispatch import AttentionShape, _Step, time_call, time_kernels

torch.set_num_threads(2)
shape = AttentionShape(9, 3, 64, torch.bfloat16, torch.bfloat16, 16)
gen = torch.Generator().manual_seed(0)
routes = {"rows": AttentionRoute(1 << 30, 1 << 30, True), "tile": AttentionRoute(1, 1, True)}
print("S ctx q rows_us tile_us tile/rows")
for n in (1, 2, 4, 7):
    for ctx in (300, 512, 1000):
        step = _Step.build(shape, [ctx + 13 * i for i in range(n)], gen)
        for q in (2, 3, 4, 5, 8):
            with torch.inference_mode():
                best = time_kernels({k: step.runs(q, r, gen) for k, r in routes.items()}, "few", q * 3, time_call)
            print(n, ctx, q, round(best["rows"] * 1e6), round(best["tile"] * 1e6),
                  round(best["tile"] / best["rows"], 2), flush=True)
