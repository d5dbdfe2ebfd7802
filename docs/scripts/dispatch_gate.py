"""The accuracy gate (`pagedllm bench accuracy`'s) for what `--dtype auto` runs on this CPU, beside plain bf16: on a
CPU without fast bf16, auto is fp32 with the lm_head in int8 where the measured dispatch finds it faster (its top 16
candidates rescored in fp32). With PAGEDLLM_KERNEL=int8 every lm_head step is int8 (the worst case).
usage: [PAGEDLLM_KERNEL=int8] python docs/scripts/dispatch_gate.py [NUM_PROMPTS] [THREADS]"""

import json
import sys

from pagedllm.bench.accuracy import run_gate

num, threads = (int(a) for a in (sys.argv[1:] + ["32", "2"])[:2])
variants = {"bf16": dict(dtype="bfloat16", quantization="none"), "auto (dtype and quantization)": {}}
result = run_gate(None, num, seed=1234, variants=variants, threads=threads, kv_cache_memory="256MiB")
print(json.dumps(result, indent=1))
