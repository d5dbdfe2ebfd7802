"""The server's traffic without the server: N closed-loop clients on the engine itself (a finished request is
replaced by the next at once), over the 200 ShareGPT-like requests (greedy, ignore_eos, exact lengths). What the
engine gives at the server's concurrency, apart from HTTP, the event loop and the benchmark client. Then the gate's
table, and the steps by how many ran (power-of-two buckets), whether a prompt ran in them and whether they had drafts:
count, seconds, ms a step.

    python docs/scripts/closed_loop_clients.py [CLIENTS]          # 64 by default; the checkout on PYTHONPATH
    PYTHONPATH=/work/wt/base python docs/scripts/closed_loop_clients.py   # another checkout
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from pagedllm.bench.datasets import sample_requests
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    clients = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    engine = LLM(None, threads=2).engine
    requests = sample_requests("sharegpt", engine.tokenizer, 200, 0)
    queue = iter(enumerate(requests))

    def submit() -> None:
        item = next(queue, None)
        if item is not None:
            i, r = item
            engine.add_request(str(i), r.prompt_token_ids,
                               SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))

    engine.wait_for_kv_cache(timeout=120)
    scheduler, steps, seconds = engine.scheduler, Counter(), Counter()
    start = time.perf_counter()
    for _ in range(clients):
        submit()
    while engine.has_unfinished_requests():
        running = scheduler.num_running_seqs
        prompt = bool(scheduler.waiting) or not all(g.is_decoding for g in scheduler.running)
        drafted, t = engine.num_draft_tokens, time.perf_counter()
        outputs = engine.step()
        key = (f"{1 << running.bit_length() >> 1}-{(1 << running.bit_length()) - 1}",
               "prompt" if prompt else "decode", "drafts" if engine.num_draft_tokens > drafted else "-")
        steps[key] += 1
        seconds[key] += time.perf_counter() - t
        for out in outputs:
            if out.finished:
                submit()
    wall = time.perf_counter() - start
    stats = engine.stats()
    print(f"{clients} clients: {sum(r.output_len for r in requests) / wall:.1f} output tokens/s, "
          f"{stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafted tokens accepted")
    for row in stats.spec_gate:
        print(row)
    for key in sorted(steps, key=lambda k: (int(k[0].split("-")[0]), k[1:])):
        print(f"running {key[0]:>7} {key[1]:>6} {key[2]:>6}: {steps[key]:4d} steps, {seconds[key]:5.2f} s, "
              f"{1000 * seconds[key] / steps[key]:5.1f} ms a step")


if __name__ == "__main__":
    main()
