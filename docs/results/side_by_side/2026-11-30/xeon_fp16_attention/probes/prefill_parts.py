"""Prefill of N-token prompts: the whole time and the attention kernel's share; with engine keyword arguments
(`dtype=float32`), and `bf16_pays=1` to make `--dtype auto` decide bf16 as where bf16 arithmetic pays (AMX).

    python prefill_parts.py N REPS [key=value ...]   (from /tmp with PYTHONSAFEPATH=1; PYTHONPATH picks the tree)

On 2026-11-30 (Intel Xeon model 207), N=1900, the defaults: at df1a2c1 attention 639-677 ms of 1,652-1,834 ms
(37-39%); at 04d2a68 436-444 ms of 1,445-1,545 ms (28-30%). On 2026-12-01, `1900 3 dtype=float32`: attention 583-609
ms at 81f6098, 557-591 at f01910e; `1900 3 bf16_pays=1` 612-668 against 570-583; `8000 1 dtype=float32
max_model_len=8192` 10.5-10.7 s against 9.9-10.4 s.
"""
import random
import sys
import time

import pagedllm.model.llama as llama
from pagedllm import LLM, SamplingParams
from pagedllm.model import bf16_choice

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1900
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
kwargs = {k: int(v) if v.isdigit() else v for k, v in (arg.split("=", 1) for arg in sys.argv[3:])}
if kwargs.pop("bf16_pays", None) == 1:
    bf16_choice.bf16_pays = lambda *a, **k: True
spent = [0.0]
orig = llama.paged_attention


def timed(*a, **k):
    t = time.perf_counter()
    out = orig(*a, **k)
    spent[0] += time.perf_counter() - t
    return out


llama.paged_attention = timed
llm = LLM(threads=2, kv_cache_memory="2GiB", **kwargs)
rng = random.Random(0)
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate([[rng.randrange(100, 40000) for _ in range(300)]], one, use_tqdm=False)
for _ in range(reps):
    p = [rng.randrange(100, 40000) for _ in range(n)]
    spent[0] = 0.0
    t = time.perf_counter()
    llm.generate([p], one, use_tqdm=False)
    dt = time.perf_counter() - t
    print(f"prefill {n}: {dt * 1e3:.0f} ms, attention {spent[0] * 1e3:.0f} ms ({spent[0] / dt:.0%}), {n / dt:.0f} tok/s",
          flush=True)
