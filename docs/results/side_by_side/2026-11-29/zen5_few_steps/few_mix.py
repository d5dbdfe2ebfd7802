import torch
from pagedllm.model.attention_dispatch import AttentionShape, _Step, time_kernels, time_call
from pagedllm.model.attention import AttentionRoute
torch.set_num_threads(2)
shape = AttentionShape(9, 3, 64, torch.bfloat16, torch.bfloat16, 16)
gen = torch.Generator().manual_seed(0)
routes = {"rows": AttentionRoute(1 << 30, 1 << 30, True), "tile": AttentionRoute(1, 1, True)}
for lo, hi in ((100, 1000), (300, 1500)):
    steps = {S: _Step.build(shape, torch.randint(lo, hi + 1, (S,), generator=gen).tolist(), gen) for S in (1, 3, 6)}
    print("contexts", lo, hi)
    for q in (1, 2, 3, 4, 5, 6, 8, 12, 16):
        tot = {"rows": 0.0, "tile": 0.0}
        per = []
        for S, step in steps.items():
            with torch.inference_mode():
                best = time_kernels({k: step.runs(q, r, gen) for k, r in routes.items()}, "few", q * 3, time_call)
            per.append(f"S{S} {best['tile'] / best['rows']:.2f}")
            for k in tot: tot[k] += best[k]
        print(q, q * 3, round(tot["rows"] * 1e6), round(tot["tile"] * 1e6), round(tot["tile"] / tot["rows"], 2), *per, flush=True)
