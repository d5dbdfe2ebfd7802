import collections
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.model import layers as L

llm = LLM(kv_cache_memory="1GiB", threads=2, num_speculative_tokens=0)
times = collections.defaultdict(list)
orig = L.PackedWeight.mm


def mm(self, x, bias=None, path=None):
    t = time.perf_counter()
    out = orig(self, x, bias, path)
    times[(self.shape[0], self.shape[1], x.shape[0])].append(time.perf_counter() - t)
    return out


L.PackedWeight.mm = mm
p = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p, use_tqdm=False)
times.clear()
t = time.perf_counter()
llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p, use_tqdm=False)
total = time.perf_counter() - t
tot = 0
for k, v in sorted(times.items()):
    if len(v) < 100:
        continue
    tot += sum(v)
    print(k, len(v), f"median {statistics.median(v) * 1e6:.1f} us")
print(f"matmuls {tot * 1e3:.0f} ms of {total * 1e3:.0f} ms")
