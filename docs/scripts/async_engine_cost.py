"""What the server's engine layer costs without HTTP: the same requests through AsyncLLMEngine.generate with
CONCURRENCY in-process clients, against the engine stepped in a plain loop at that many sequences, alternated.
Each run in a fresh process, the engine built off the main thread as the server builds it:
    python docs/scripts/async_engine_cost.py WORKLOAD_JSONL [ROUNDS] [CONCURRENCY]
WORKLOAD_JSONL as `pagedllm bench throughput --save-workload` writes it.
"""

import asyncio
import json
import subprocess
import sys
import time

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, build_serving_engine


def params(r: dict) -> SamplingParams:
    n = r["output_len"]
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)


def run(mode: str, path: str, concurrency: int) -> None:
    reqs = [json.loads(line) for line in open(path)]
    engine = build_serving_engine(EngineConfig(threads=2, max_num_seqs=concurrency))
    start = time.perf_counter()
    if mode == "loop":
        for i, r in enumerate(reqs):
            engine.add_request(str(i), r["prompt_token_ids"], params(r))
        while engine.has_unfinished_requests():
            engine.step()
    else:
        async def clients() -> None:
            ae = AsyncLLMEngine(engine, max_waiting_requests=len(reqs))
            ae.start()
            todo = iter(enumerate(reqs))

            async def client() -> None:
                for i, r in todo:
                    async for _ in ae.generate(str(i), r["prompt_token_ids"], params(r)):
                        pass

            await asyncio.gather(*[client() for _ in range(concurrency)])
            ae.shutdown()

        asyncio.run(clients())
    tokens = sum(r["output_len"] for r in reqs)
    print(f"{mode}: {tokens / (time.perf_counter() - start):.1f} output tokens/s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 4:
        run(sys.argv[4], sys.argv[1], int(sys.argv[3]))
    else:
        path, rounds, conc = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2, sys.argv[3] if len(
            sys.argv) > 3 else "64"
        for _ in range(rounds):
            for mode in ("loop", "async"):
                subprocess.run([sys.executable, __file__, path, "1", conc, mode], check=True)
