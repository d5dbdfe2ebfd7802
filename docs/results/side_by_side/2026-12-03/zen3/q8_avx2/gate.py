"""The accuracy gate on this CPU with the 4-bit weights against int8 activations (AVX2's vpmaddubsw kernel): the
default `--dtype auto` (fp32 here; the measured dispatch picks each route), every layer matmul forced onto int4_q8,
and fp32's exact 4-bit kernel. usage: python gate.py NUM_PROMPTS"""
import json
import sys

from pagedllm.bench.accuracy import run_gate
from pagedllm.model import dispatch

variants = {"bf16": dict(dtype="bfloat16", quantization="none"),
            "dtype auto (default)": dict(dtype="auto"),
            "dtype auto, every layer on int4_q8": dict(dtype="auto", environment={dispatch.FORCE_ENV: "int4_q8"}),
            "dtype auto, every layer on int4 (exact)": dict(dtype="auto", environment={dispatch.FORCE_ENV: "int4"})}
result = run_gate(None, int(sys.argv[1]), seed=1234, variants=variants, kv_cache_memory="256MiB")
print(json.dumps(result["variants"], indent=1))
