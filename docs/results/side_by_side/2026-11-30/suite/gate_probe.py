"""Time each part of the accuracy gate's test: the builds and the first steps per variant (a probe)."""
import time

from pagedllm.bench import accuracy
from pagedllm.entrypoints.llm import LLM

variants = {"ref": dict(dtype="float32"), "bf16": dict(dtype="bfloat16", quantization="none"),
            "auto": dict(dtype="bfloat16"), "auto + int8 KV": dict(dtype="bfloat16", kv_cache_dtype="int8"),
            "w8a8": dict(dtype="bfloat16", quantization="w8a8"),
            "fp32 + bf16 KV": dict(dtype="float32", kv_cache_dtype="bfloat16"), "fp32": dict(dtype="float32")}
prompts = None
ref = None
for name, kw in variants.items():
    t = time.perf_counter()
    llm = LLM(None, kv_cache_memory="256MiB", **kw)
    built = time.perf_counter() - t
    if prompts is None:
        prompts = accuracy.held_out_prompts(llm.get_tokenizer(), 24, 1234)
    t = time.perf_counter()
    out = accuracy.first_steps(llm, prompts)
    ran = time.perf_counter() - t
    if ref is None:
        ref = out
    err = accuracy.compare(ref, out).__dict__
    print(f"{name:16} build {built:5.1f} s  steps {ran:5.1f} s  {err}", flush=True)
    del llm
