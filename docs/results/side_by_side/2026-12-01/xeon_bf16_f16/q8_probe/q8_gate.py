"""Would int8 activations per group of 32 inputs (llama.cpp's Q8 blocks, symmetric, scale = absmax / 127) pass the
accuracy gate on the 4-bit layers? Fake-quantised activations into the exact fp32 4-bit kernel (its products are then
those of a Q4 x Q8 integer kernel, up to fp32's summing order), against plain bf16, on `pagedllm bench accuracy`'s
held-out prompts. Run: PYTHONPATH=TREE python q8_gate.py [NUM_PROMPTS] [GROUP] [KEEP]"""
import os
import sys

import torch

from pagedllm.bench import accuracy
from pagedllm.entrypoints.llm import LLM
from pagedllm.model.weight_forms import Int4Weight

num, group, keep = (int(a) for a in (sys.argv[1:] + ["32", "32", "0"])[:3])  # keep: each row's largest |x| exact
PER_CALL = os.environ.get("PER_CALL") == "1"  # ... or the call's `keep` channels of largest |x| over its rows
ONLY_K = int(os.environ.get("ONLY_K", "0"))  # if set: only the matmuls of this many inputs take int8 activations


def fake_q8(x: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    xf = x.float()
    out = torch.zeros_like(xf)
    if keep:  # outlier channels out of the int8 product, as exact products beside it
        idx = (xf.abs().amax(0).topk(keep).indices.expand(m, keep) if PER_CALL
               else xf.abs().topk(keep, dim=1).indices)
        out.scatter_(1, idx, xf.gather(1, idx))
        xf = xf.scatter(1, idx, 0.0)
    g = xf.view(m, k // group, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (out + ((g / scale).round().clamp(-127, 127) * scale).view(m, k)).to(x.dtype)


reference_llm = LLM(None, dtype="float32", kv_cache_memory="256MiB")
prompts = accuracy.held_out_prompts(reference_llm.get_tokenizer(), num, 1234)
reference = accuracy.first_steps(reference_llm, prompts)
del reference_llm
rows = {}
os.environ["PAGEDLLM_ATTENTION"] = "static"
for name, kwargs, patch in (("bf16", dict(dtype="bfloat16", quantization="none"), False),
                            ("fp32 4-bit, exact", dict(dtype="float32", quantization="int4"), False),
                            (f"fp32 4-bit, Q8 per {group}, {keep} kept{' per call' if PER_CALL else ''}"
                             f"{f', K {ONLY_K} only' if ONLY_K else ''}",
                             dict(dtype="float32", quantization="int4"), True)):
    os.environ["PAGEDLLM_KERNEL"] = "int4" if kwargs["quantization"] == "int4" else "static"
    mm = Int4Weight.mm
    if patch:
        def quantised(self, x, mm=mm):
            return mm(self, fake_q8(x) if ONLY_K in (0, x.shape[1]) else x)
        Int4Weight.mm = quantised
    llm = LLM(None, kv_cache_memory="256MiB", **kwargs)
    rows[name] = accuracy.compare(reference, accuracy.first_steps(llm, prompts))
    Int4Weight.mm = mm
    del llm
base = rows["bf16"].mean_top5_logprob_error
print(f"{num} prompts, seed 1234, groups of {group}, each row's {keep} largest |x| kept exact")
for name, r in rows.items():
    print(f"{name:36s} first token {r.first_token_agreement:6.1%}  top-5 err {r.mean_top5_logprob_error:.4f}"
          f"  max {r.max_top5_logprob_error:.3f}  {r.mean_top5_logprob_error / base:.2f}x bf16")
