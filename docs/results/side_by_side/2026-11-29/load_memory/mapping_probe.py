"""The RSS of one model's build from a safetensors folder, step by step (loaded, built, after malloc_trim), and the
process's largest mappings after it: which of them the build left resident. usage: python mapping_probe.py HF_FOLDER"""
import ctypes
import gc
import re
import sys

import torch


def rss() -> float:
    f = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(f["VmRSS"].split()[0]) / 1e6


from pagedllm.model.llama import LlamaModel  # noqa: E402
from pagedllm.model.loader import load_model  # noqa: E402

w = torch.randn(8192, 2048)
r0 = rss()
p = torch.ops.mkldnn._reorder_linear_weight(w)
print(f"one 8192x2048 fp32 ({w.numel() * 4 / 1e6:.0f} MB) packed: +{(rss() - r0) * 1e3:.0f} MB")
del w, p
gc.collect()
print("rss start", rss())
loaded = load_model(sys.argv[1], torch.float32)
print("loaded", rss())
model = LlamaModel(loaded.config, loaded.weights, torch.float32)
gc.collect()
print("built", rss(), "left in dict", len(loaded.weights))
ctypes.CDLL("libc.so.6").malloc_trim(0)
print("after malloc_trim", rss())
maps, cur = [], None
for line in open("/proc/self/smaps"):
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        parts = line.split()
        cur = [parts[0], parts[-1] if len(parts) > 5 else "[anon]", 0]
        maps.append(cur)
    elif line.startswith("Rss:"):
        cur[2] = int(line.split()[1])
maps.sort(key=lambda m: -m[2])
print("mappings", len(maps), "top:", [(m[1], m[2] // 1024) for m in maps[:8]])
big = [m for m in maps if m[2] > 65536]
print("sum of mappings > 64 MB", sum(m[2] for m in big) // 1024, "MB in", len(big))
