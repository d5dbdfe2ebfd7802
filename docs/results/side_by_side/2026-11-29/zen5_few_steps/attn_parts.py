"""The 200-request workload through LLM.generate under the step timers: total seconds in attention, per route."""
import json, os, sys, time
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.model.attention import AttentionRoute
torch.set_num_threads(2)
reqs = [json.loads(l) for l in open(sys.argv[1])]
llm = LLM(threads=2)
model = llm.engine.runner.model
routes = {}
for spec in sys.argv[2:]:
    a, b = (int(x) for x in spec.split(","))
    routes[spec] = AttentionRoute(a, b, True)
routes["measured"] = model.attention_route
print("measured route:", model.attention_route)
prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
params = [SamplingParams(max_tokens=r["output_len"], min_tokens=r["output_len"], ignore_eos=True, temperature=0) for r in reqs]
llm.generate(prompts[:8], params[:8])  # warm-up
for rnd in range(2):
    for name, route in routes.items():
        model.attention_route = route
        llm.engine.reset_prefix_cache()
        with llm.engine.step_timers() as timers:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False) if "use_tqdm" in LLM.generate.__code__.co_varnames else llm.generate(prompts, params)
            el = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"round {rnd} {name}: {el:.2f} s, {toks/el:.1f} tok/s, attn {timers.seconds['attention']:.2f} s", flush=True)
