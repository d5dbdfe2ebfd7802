import os, sys, json
from pagedllm.bench.accuracy import run_gate
from pagedllm.model import dispatch, attention_dispatch
n, seed = int(sys.argv[1]), int(sys.argv[2])
pinned = {dispatch.FORCE_ENV: "static", attention_dispatch.FORCE_ENV: "static"}
variants = {"bf16": dict(dtype="bfloat16", quantization="none", environment=pinned),
            "auto(static)": dict(dtype="bfloat16", environment=pinned)}
for kinds in sys.argv[3:]:
    variants["q8 " + kinds] = dict(dtype="bfloat16", environment={**pinned, dispatch.FORCE_ENV: "int4_q8", "Q8_BF16": "1", "Q8_KINDS": kinds})
r = run_gate(None, n, seed=seed, variants=variants, kv_cache_memory="256MiB")["variants"]
for k, v in r.items(): print(f"{k:28s} err {v['mean_top5_logprob_error']:.4f} x{v['error_vs_bf16']} first {v['first_token_agreement']:.3f} pass {v['passes']}")
