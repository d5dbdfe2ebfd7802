"""The server's traffic without the server: N closed-loop clients on the engine itself (a finished request is
replaced by the next at once), over the 200 ShareGPT-like requests (greedy, ignore_eos, exact lengths). What the
engine gives at the server's concurrency, apart from HTTP, the event loop and the benchmark client.

    python docs/scripts/closed_loop_clients.py [CLIENTS]          # 64 by default; the checkout on PYTHONPATH
    PYTHONPATH=/work/wt/base python docs/scripts/closed_loop_clients.py   # another checkout
"""

from __future__ import annotations

import sys
import time

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
    start = time.perf_counter()
    for _ in range(clients):
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                submit()
    wall = time.perf_counter() - start
    stats = engine.stats()
    print(f"{clients} clients: {sum(r.output_len for r in requests) / wall:.1f} output tokens/s, "
          f"{stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafted tokens accepted")
    for row in stats.spec_gate:
        print(row)


if __name__ == "__main__":
    main()
