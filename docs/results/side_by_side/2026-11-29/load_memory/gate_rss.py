"""RSS of a process that runs the accuracy gate (3 variants, 4 prompts: 4 engines one after another) twice: what
the engines it dropped leave behind, before and after a full garbage collection and malloc_trim."""
import ctypes
import gc

from pagedllm.bench.accuracy import run_gate


def rss() -> int:
    f = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(f["VmRSS"].split()[0]) // 1024


variants = {"bf16": dict(dtype="bfloat16", quantization="none"), "auto": dict(dtype="bfloat16"),
            "fp32": dict(dtype="float32")}
print("start", rss())
for i in range(2):
    run_gate(None, 4, seed=1234, variants=variants, kv_cache_memory="256MiB")
    print("after gate", i, rss())
    gc.collect()
    print("after gc", rss())
ctypes.CDLL("libc.so.6").malloc_trim(0)
print("after malloc_trim", rss())
