"""How many distinct channels do the rows of one 4-bit matmul call put in their own top-4 |x|? (The Q4 x Q8 lead:
each row's outliers kept exact need the weights' columns of their union.) The default model, fp32 with every layer on
the exact 4-bit kernel, the gate's 32 held-out prompts at once, then 16 decode steps. Run: PYTHONPATH=TREE python
outlier_union.py"""
import collections
import os

os.environ["PAGEDLLM_KERNEL"] = "int4"
from pagedllm.bench import accuracy  # noqa: E402
from pagedllm.entrypoints.llm import LLM  # noqa: E402
from pagedllm.model.weight_forms import Int4Weight  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

sizes = collections.defaultdict(list)  # K -> [(rows, union size)]
mm = Int4Weight.mm


def recording(self, x):
    top = x.abs().topk(4, dim=1).indices
    sizes[x.shape[1]].append((x.shape[0], int(top.unique().numel())))
    return mm(self, x)


Int4Weight.mm = recording
llm = LLM(None, dtype="float32", quantization="int4", kv_cache_memory="256MiB")
prompts = accuracy.held_out_prompts(llm.get_tokenizer(), 32, 1234)
llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
             use_tqdm=False)
for k, calls in sorted(sizes.items()):
    for lo, hi in ((1, 64), (65, 100000)):
        u = sorted(n for rows, n in calls if lo <= rows <= hi)
        if u:
            print(f"K {k}, calls of {lo}-{hi} rows: {len(u)} calls, union of the rows' top-4 channels: "
                  f"median {u[len(u) // 2]}, 90th percentile {u[int(len(u) * 0.9)]}, max {u[-1]}")
