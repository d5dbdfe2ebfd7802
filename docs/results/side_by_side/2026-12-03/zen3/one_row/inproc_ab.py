"""One sequence's decode in one process, every layer matmul on int4_q8 (PAGEDLLM_KERNEL=int4_q8), its kernel switched
between two builds of int4_linear_q8.cpp (main's; the one-row path) every generate call; output tokens/s."""
import gc, os, statistics, sys, time
os.environ["PAGEDLLM_KERNEL"] = "int4_q8"
import torch
from torch.utils.cpp_extension import load
from pagedllm import LLM, SamplingParams
from pagedllm.model.weight_forms import Int4Weight

mods = {}
for name, src in [("main", "/work/main/pagedllm/model/csrc"), ("v0", "/tmp/wt/onerow/pagedllm/model/csrc")]:
    mods[name] = load(name=f"q8var_{name}", sources=[f"{src}/int4_linear_q8.cpp", "/tmp/exp/var/bind.cpp"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp", f"-I{src}"], extra_ldflags=["-fopenmp"])
llm = LLM(num_speculative_tokens=0, threads=2)
weights = [o for o in gc.get_objects() if isinstance(o, Int4Weight)]
class Proxy:
    def __init__(self, ext): self._ext = ext; self.int4_linear_q8 = None
    def __getattr__(self, k): return getattr(self._ext, k)
proxy = Proxy(weights[0].ext)
for w in weights: w.ext = proxy
print(len(weights), "weights")
sp = SamplingParams(max_tokens=int(sys.argv[1]) if len(sys.argv) > 1 else 256, ignore_eos=True, temperature=0.0)
prompt = {"prompt_token_ids": list(range(100, 400))}
rates = {k: [] for k in mods}
outs = {}
for it in range(int(sys.argv[2]) if len(sys.argv) > 2 else 8):
    for k, m in mods.items():
        proxy.int4_linear_q8 = m.int4_linear_q8
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)
        rates[k].append(sp.max_tokens / (time.perf_counter() - t))
        outs.setdefault(k, out[0].outputs[0].token_ids)
        assert out[0].outputs[0].token_ids == outs[k]
print("same tokens:", outs["main"] == outs["v0"])
for k, v in rates.items():
    print(k, "median %.1f tok/s" % statistics.median(v), " ".join(f"{x:.1f}" for x in v))
print("pairwise v0/main:", " ".join(f"{b/a:.2f}" for a, b in zip(rates["main"], rates["v0"])))
