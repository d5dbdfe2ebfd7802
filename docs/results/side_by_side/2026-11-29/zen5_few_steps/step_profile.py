"""Per-step duration by running sequences over a workload file (argv[1]), offline, in one process: where a run's
time goes (the KV pool mapped first, as `bench throughput` does; greedy, ignore_eos, each request's output length)."""

import collections
import json
import sys
import time

from pagedllm import LLM, SamplingParams

reqs = [json.loads(line) for line in open(sys.argv[1])]
llm = LLM(threads=2)
eng = llm.engine
eng.wait_for_kv_cache()
prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
params = [SamplingParams(max_tokens=r["output_len"], ignore_eos=True, temperature=0) for r in reqs]
llm.generate(prompts[:8], params[:8])
eng.reset_prefix_cache()
step, log = eng.step, []


def timed_step():
    running, start = eng.num_running, time.perf_counter()
    out = step()
    log.append((running, time.perf_counter() - start))
    return out


eng.step = timed_step
t0 = time.perf_counter()
outs = llm.generate(prompts, params)
elapsed = time.perf_counter() - t0
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(f"{elapsed:.2f} s, {tokens / elapsed:.1f} tok/s, {len(log)} steps")
edges = [(1, "1"), (3, "2-3"), (7, "4-7"), (15, "8-15"), (63, "16-63"), (127, "64-127"), (10**9, "128+")]
bins = collections.OrderedDict((name, [0, 0.0]) for _, name in edges)
for running, seconds in log:
    name = next(n for top, n in edges if running <= top)
    bins[name][0] += 1
    bins[name][1] += seconds
for name, (count, seconds) in bins.items():
    print(f"running {name:>7}: {count:5d} steps, {seconds:6.2f} s ({seconds / elapsed * 100:4.1f}%), "
          f"{seconds / max(count, 1) * 1e3:6.1f} ms/step")
