"""Offline output tokens/s of workload W with every request sampled (temperature, top_p as given), ignore_eos and
exact lengths, on whichever pagedllm is first on PYTHONPATH (to set a checkout against another, alternated).
Run: python offline_sampled.py WORKLOAD.jsonl TEMPERATURE TOP_P
"""

import json
import sys
import time

import pagedllm
from pagedllm import LLM, SamplingParams

rows = [json.loads(line) for line in open(sys.argv[1])]
temperature, top_p = float(sys.argv[2]), float(sys.argv[3])
llm = LLM()
prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=r["output_len"], ignore_eos=True)
          for r in rows]
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - start
n = sum(len(c.token_ids) for o in outs for c in o.outputs)
print(f"{pagedllm.__file__}: temperature {temperature}, top_p {top_p}: {n} output tokens in {elapsed:.1f} s, "
      f"{n / elapsed:.1f} tokens/s")
