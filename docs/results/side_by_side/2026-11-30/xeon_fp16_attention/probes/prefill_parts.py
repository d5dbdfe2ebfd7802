"""Prefill of N-token prompts with the defaults: the whole time and the attention kernel's share.

    python prefill_parts.py N REPS   (from /tmp with PYTHONSAFEPATH=1)

On 2026-11-30 (Intel Xeon model 207), N=1900: at df1a2c1 attention 639-677 ms of 1,652-1,834 ms (37-39%);
at 04d2a68 436-444 ms of 1,445-1,545 ms (28-30%).
"""
import sys, time, random
import pagedllm.model.llama as llama
from pagedllm import LLM, SamplingParams

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1900
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
spent = [0.0]
orig = llama.paged_attention
def timed(*a, **k):
    t = time.perf_counter(); out = orig(*a, **k); spent[0] += time.perf_counter() - t; return out
llama.paged_attention = timed
llm = LLM(threads=2, kv_cache_memory="2GiB")
rng = random.Random(0)
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate([[rng.randrange(100, 40000) for _ in range(300)]], one, use_tqdm=False)
for i in range(reps):
    p = [rng.randrange(100, 40000) for _ in range(n)]
    spent[0] = 0.0
    t = time.perf_counter(); llm.generate([p], one, use_tqdm=False); dt = time.perf_counter() - t
    print(f"prefill {n}: {dt*1e3:.0f} ms, attention {spent[0]*1e3:.0f} ms ({spent[0]/dt:.0%}), {n/dt:.0f} tok/s", flush=True)
