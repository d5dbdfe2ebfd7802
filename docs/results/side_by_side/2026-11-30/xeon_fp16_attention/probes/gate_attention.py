"""The accuracy gate (bench/accuracy.run_gate) with and without the prompts' attention on fp16 products: the
defaults as `--dtype auto` chooses them here (the measured attention route takes the fp16 tiles where they are
faster), the same with the hand-set attention route (PAGEDLLM_ATTENTION=static: fp32 tiles), and an explicit float32
over a bf16 cache (exact products throughout).

    python docs/results/side_by_side/2026-11-30/xeon_fp16_attention/probes/gate_attention.py 32
"""
import sys

from pagedllm.bench.accuracy import run_gate

variants = {"bf16": dict(dtype="bfloat16", quantization="none"),
            "auto (fp16 tiles + int4_f16 + int8 lm_head)": dict(dtype="auto"),
            "auto, fp32 tiles (attention static)": dict(dtype="auto", environment={"PAGEDLLM_ATTENTION": "static"}),
            "fp32 explicit + bf16 KV": dict(dtype="float32", kv_cache_dtype="bfloat16")}
r = run_gate(None, int(sys.argv[1]), seed=1234, variants=variants, threads=2)
print(f"{r['num_prompts']} prompts, mean {r['mean_prompt_tokens']} tokens")
for k, v in r["variants"].items():
    print(f"{k:44s} agree {v['first_token_agreement']:.3f} err {v['mean_top5_logprob_error']:.4f} "
          f"max {v['max_top5_logprob_error']:.3f} vs bf16 {v['error_vs_bf16']}")
