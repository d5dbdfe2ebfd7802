"""The accuracy gate (bench/accuracy.run_gate) on the variants that tell the fp16 products apart: the defaults as
`--dtype auto` chooses them here, the same with every layer matmul forced onto the exact fp32 4-bit kernel or onto the
fp16 one, and an explicit float32 over a bf16 cache.

    python docs/results/side_by_side/2026-11-30/xeon_fp16/probes/gate_variants.py 32
"""
import sys

from pagedllm.bench.accuracy import run_gate

variants = {"bf16": dict(dtype="bfloat16", quantization="none"),
            "auto (fp32 + f16 + int8 lm_head)": dict(dtype="auto"),
            "auto, int4 fp32 forced": dict(dtype="auto", environment={"PAGEDLLM_KERNEL": "int4"}),
            "auto, int4_f16 forced": dict(dtype="auto", environment={"PAGEDLLM_KERNEL": "int4_f16"}),
            "fp32 explicit + bf16 KV": dict(dtype="float32", kv_cache_dtype="bfloat16")}
r = run_gate(None, int(sys.argv[1]), seed=1234, variants=variants, threads=2)
for k, v in r["variants"].items():
    print(f"{k:36s} agree {v['first_token_agreement']:.3f} err {v['mean_top5_logprob_error']:.4f} "
          f"max {v['max_top5_logprob_error']:.3f} vs bf16 {v['error_vs_bf16']}")
