"""Row vs tiled kernel in steps of few sequences: S sequences x context x queries, the dispatch's own timing."""
import torch, sys
from pagedllm.model.attention_dispatch import AttentionShape, _Step, time_kernels, time_call
from pagedllm.model.attention import AttentionRoute
torch.set_num_threads(2)
shape = AttentionShape(9, 3, 64, torch.bfloat16, torch.bfloat16, 16)
gen = torch.Generator().manual_seed(0)
routes = {"rows": AttentionRoute(1 << 30, 1 << 30, True), "tile": AttentionRoute(1, 1, True)}
print("S ctx q rows_us tile_us tile/rows")
for S in (1, 2, 4, 7):
    for ctx in (300, 512, 1000):
        step = _Step.build(shape, [ctx + 13 * i for i in range(S)], gen)
        for q in (2, 3, 4, 5, 8):
            with torch.inference_mode():
                best = time_kernels({k: step.runs(q, r, gen) for k, r in routes.items()}, "few", q * 3, time_call)
            print(S, ctx, q, round(best["rows"] * 1e6), round(best["tile"] * 1e6), round(best["tile"] / best["rows"], 2), flush=True)
