"""The accuracy gate's engines one by one: build and 24 prompts' first step each (the default model, 256 MiB KV)."""

import time

from pagedllm.bench.accuracy import first_steps, held_out_prompts
from pagedllm.entrypoints.llm import LLM

VARIANTS = {"ref": dict(dtype="float32"), "bf16": dict(dtype="bfloat16", quantization="none"),
            "auto": dict(dtype="bfloat16"), "auto + int8 KV": dict(dtype="bfloat16", kv_cache_dtype="int8"),
            "w8a8": dict(dtype="bfloat16", quantization="w8a8"),
            "fp32 + bf16 KV": dict(dtype="float32", kv_cache_dtype="bfloat16"), "fp32": dict(dtype="float32")}

prompts = None
for name, kw in VARIANTS.items():
    t0 = time.perf_counter()
    llm = LLM(None, kv_cache_memory="256MiB", **kw)
    t1 = time.perf_counter()
    if prompts is None:
        prompts = held_out_prompts(llm.get_tokenizer(), 24, 1234)
    first_steps(llm, prompts)
    print(f"{name}: build {t1 - t0:.1f}s generate {time.perf_counter() - t1:.1f}s", flush=True)
    del llm
