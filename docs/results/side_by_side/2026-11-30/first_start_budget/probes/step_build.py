"""The attention measurement's steps: seconds to build each regime's, their layer copies and MiB (keys and values)."""
import time

import torch

from pagedllm.model import attention_dispatch as ad

torch.set_num_threads(2)
shape = ad.AttentionShape(9, 3, 64, torch.float32, torch.bfloat16, 16)
gen = torch.Generator().manual_seed(0)
for regime in ("few", "busy", "few"):
    s = time.perf_counter()
    contexts = ad.step_contexts(regime, gen)
    steps = [ad._Step.build(shape, lens, gen, ad.layer_copies(shape, contexts)) for lens in contexts]
    mib = sum(st.pools[0].numel() * 2 * 2 for st in steps) >> 20
    print(regime, round(time.perf_counter() - s, 3), [len(st.tables) for st in steps], mib, "MiB")
