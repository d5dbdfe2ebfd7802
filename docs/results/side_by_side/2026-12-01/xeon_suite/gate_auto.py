"""The gate with plain bf16, auto (bf16 + 4-bit + int8 where measured faster) and auto with the 4-bit weights only,
each on the routes its engine measures, with the accuracy test's patches: one line per process. gate_runs.sh ran it
three times quiet, three times beside `docs/scripts/cpu_noise.py 1.0` (04:53-05:00): gate_measured_routes.txt."""
import dataclasses

from pagedllm.bench.accuracy import run_gate
from pagedllm.model import attention_dispatch, bf16_choice

bf16_choice.bf16_pays = lambda *a, **k: False
measured_route = attention_dispatch.AttentionTable.route
attention_dispatch.AttentionTable.route = lambda table: dataclasses.replace(
    measured_route(table), tile_f16="f16" in table.tile_forms)
variants = {"bf16": dict(dtype="bfloat16", quantization="none"), "auto": dict(dtype="bfloat16"),
            "auto int4": dict(dtype="bfloat16", quantization="int4")}
rows = run_gate(None, 24, seed=1234, variants=variants, kv_cache_memory="256MiB")["variants"]
print(" | ".join(f"{k}: agree {v['first_token_agreement']:.3f} err {v['mean_top5_logprob_error']:.4f} "
                 f"x{v['error_vs_bf16']}" for k, v in rows.items()), flush=True)
