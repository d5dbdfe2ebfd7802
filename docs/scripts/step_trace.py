"""Where an offline run's time goes: every engine.step() of the ShareGPT-like workload timed, grouped by how many
requests are running:
    python docs/scripts/step_trace.py 200
"""

import sys
import time
from collections import defaultdict

from pagedllm import LLM, SamplingParams
from pagedllm.bench.datasets import sample_requests

llm = LLM()
engine = llm.engine
for i, r in enumerate(sample_requests("sharegpt", llm.get_tokenizer(), int(sys.argv[1]), 0)):
    engine.add_request(str(i), r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.output_len,
                                                                  ignore_eos=True))
groups: dict[str, list[float]] = defaultdict(list)
start = time.perf_counter()
while engine.has_unfinished_requests():
    running = len(engine.scheduler.running)
    t = time.perf_counter()
    engine.step()
    label = "1-4" if running <= 4 else "5-16" if running <= 16 else "17-64" if running <= 64 else "65+"
    groups[label].append(time.perf_counter() - t)
print(f"{time.perf_counter() - start:.1f} s, {sum(map(len, groups.values()))} steps")
for label in ("65+", "17-64", "5-16", "1-4"):
    t = groups[label]
    print(f"running {label:>5}: {len(t):4d} steps, {sum(t):5.1f} s, {sum(t) / max(1, len(t)) * 1e3:6.1f} ms/step")
