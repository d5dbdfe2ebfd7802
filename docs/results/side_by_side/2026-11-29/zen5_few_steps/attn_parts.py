"""The 200-request workload (argv[1]) through LLM.generate in one process, under the engine's step timers, once per
attention route given as BUSY,FEW rows (argv[2:]) and the measured one, twice: total time and seconds in attention."""

import json
import sys
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.attention import AttentionRoute

torch.set_num_threads(2)
reqs = [json.loads(line) for line in open(sys.argv[1])]
llm = LLM(threads=2)
model = llm.engine.runner.model
routes = {spec: AttentionRoute(*(int(x) for x in spec.split(",")), True) for spec in sys.argv[2:]}
routes["measured"] = model.attention_route
print("measured route:", model.attention_route)
prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
params = [SamplingParams(max_tokens=r["output_len"], min_tokens=r["output_len"], ignore_eos=True, temperature=0)
          for r in reqs]
llm.generate(prompts[:8], params[:8])  # warm-up
for rnd in range(2):
    for name, route in routes.items():
        model.attention_route = route
        llm.engine.reset_prefix_cache()
        with llm.engine.step_timers() as timers:
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"round {rnd} {name}: {elapsed:.2f} s, {tokens / elapsed:.1f} tok/s, "
              f"attn {timers.seconds['attention']:.2f} s", flush=True)
