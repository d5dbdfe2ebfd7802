"""The accuracy gate with the variant `--dtype auto` runs on this CPU (fp32 + int8 lm_head where no fast bf16)."""
import json
import sys

from pagedllm.bench.accuracy import run_gate

variants = {"bf16": dict(dtype="bfloat16", quantization="none"),
            "default (auto, bf16)": dict(dtype="bfloat16", quantization="auto"),
            "dtype auto (fp32 here)": dict(dtype="auto", quantization="auto"),
            "fp32 + bf16 KV cache": dict(dtype="float32", quantization="auto", kv_cache_dtype="bfloat16")}
result = run_gate(None, int(sys.argv[1]), seed=1234, variants=variants, kv_cache_memory="256MiB")
print(json.dumps(result["variants"], indent=1))
