"""The gate (bench/accuracy.run_gate, 24 held-out prompts, seed 1234) with bf16 variants on forced routes: which
choice moves the error. From a folder outside the checkout: PYTHONPATH=REPO python gate_combo.py"""
from pagedllm.bench.accuracy import run_gate


def forced(kernel: str) -> dict[str, str]:
    return {"PAGEDLLM_KERNEL": kernel, "PAGEDLLM_ATTENTION": "static"}


combos = {f"bf16 {k} att=static": dict(dtype="bfloat16", quantization="none", environment=forced(k))
          for k in ("onednn", "bf16_gemm", "static")}
combos |= {f"auto {k} att=static": dict(dtype="bfloat16", environment=forced(k)) for k in ("static", "int4", "int8")}
rows = run_gate(None, 24, seed=1234, variants=combos, kv_cache_memory="256MiB")["variants"]
for name, row in rows.items():
    print(f"{name:32s} agree {row['first_token_agreement']:.3f} err {row['mean_top5_logprob_error']:.4f}", flush=True)
