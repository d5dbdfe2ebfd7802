"""Output tokens/s of a workload's requests, sampled (temperature, top_p), with n-gram drafts on (the default, 4) or
off (0), on whichever pagedllm is first on PYTHONPATH. CONCURRENCY 1 runs the requests one after another (a single
stream); 0 runs them all at once. LENGTHS "exact" ignores EOS at each request's output_len, "eos" stops at EOS (the
edit requests: their answers end).
Run: python sampled_drafts.py WORKLOAD.jsonl DRAFTS TEMPERATURE TOP_P CONCURRENCY LENGTHS
"""

import json
import sys
import time

from pagedllm import LLM, SamplingParams

path, drafts, temperature, top_p, concurrency, lengths = sys.argv[1:7]
rows = [json.loads(line) for line in open(path)]
llm = LLM(num_speculative_tokens=int(drafts))
params = [SamplingParams(temperature=float(temperature), top_p=float(top_p), max_tokens=r["output_len"],
                         ignore_eos=lengths == "exact") for r in rows]
prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up: first-step costs off the clock
engine = llm.engine
before = engine.num_draft_tokens, engine.num_accepted_tokens
start = time.perf_counter()
if concurrency == "1":
    outs = [out for prompt, p in zip(prompts, params) for out in llm.generate([prompt], p, use_tqdm=False)]
else:
    outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - start
n = sum(len(c.token_ids) for o in outs for c in o.outputs)
proposed, kept = engine.num_draft_tokens - before[0], engine.num_accepted_tokens - before[1]
print(f"drafts {drafts}, temperature {temperature}, top_p {top_p}, concurrency {concurrency}: {n} output tokens in "
      f"{elapsed:.1f} s, {n / elapsed:.1f} tokens/s; {proposed} tokens proposed, {kept} kept")
