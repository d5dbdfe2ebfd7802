"""The gate on pinned routes with the prompts' attention for bf16 queries in each tile form: run with a copy of
pagedllm whose `attention.cpp_attention` was patched (not committed) to pass bf16 queries as fp32, tile_pairs off,
and tile_f16 = (EXP_BF16_Q == "f16") when EXP_BF16_Q is set: EXP_BF16_Q= (vdpbf16ps, the static route), fp32, f16."""
import os

from pagedllm.bench.accuracy import run_gate

pinned = {"PAGEDLLM_KERNEL": "static", "PAGEDLLM_ATTENTION": "static"}
v = {"bf16": dict(dtype="bfloat16", quantization="none", environment=pinned),
     "auto": dict(dtype="bfloat16", environment=pinned)}
r = run_gate(None, 24, seed=1234, variants=v, kv_cache_memory="256MiB")["variants"]
print(os.environ.get("EXP_BF16_Q", "pairs"), " | ".join(
    f"{k}: {x['first_token_agreement']:.3f} {x['mean_top5_logprob_error']:.4f}" for k, x in r.items()), flush=True)
