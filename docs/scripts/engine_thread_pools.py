"""An engine built in one thread and stepped in another, as a server runs it: AsyncLLMEngine with 64 in-process
clients (no HTTP) over a workload file, the engine built either by the main thread (what the servers did) or by
`build_off_main_thread` (what they do now). Prints output tokens/s and the voluntary context switches of the
process: with two OpenMP pools libgomp stops spinning its workers, and the engine thread sleeps at every parallel
region.

    python docs/scripts/engine_thread_pools.py WORKLOAD_JSONL --build-in main
    python docs/scripts/engine_thread_pools.py WORKLOAD_JSONL --build-in thread

WORKLOAD_JSONL as `pagedllm bench throughput --save-workload` writes it. Alternate the two, several times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, build_off_main_thread
from pagedllm.engine.llm_engine import LLMEngine


async def serve(llm: LLMEngine, requests: list[dict], clients: int) -> int:
    """`clients` coroutines, each sending the next request when its last one ends; the tokens generated."""
    engine = AsyncLLMEngine(llm, max_waiting_requests=len(requests))
    engine.start()  # in the running loop: the engine thread posts its outputs to it
    todo = iter(enumerate(requests))
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        for i, r in todo:
            params = SamplingParams(temperature=0, max_tokens=r["output_len"], min_tokens=r["output_len"],
                                    ignore_eos=True)
            last = None
            async for last in engine.generate(str(i), r["prompt_token_ids"], params):  # noqa: B007 (the final one)
                pass
            tokens += len(last.outputs[0].token_ids)

    await asyncio.gather(*(client() for _ in range(clients)))
    engine.shutdown()
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload")
    ap.add_argument("--build-in", choices=["main", "thread"], required=True)
    ap.add_argument("--clients", type=int, default=64)
    args = ap.parse_args()
    with open(args.workload) as f:
        requests = [json.loads(line) for line in f]
    config = EngineConfig(threads=2)
    llm = LLMEngine(config) if args.build_in == "main" else build_off_main_thread(lambda: LLMEngine(config))
    llm.wait_for_kv_cache()
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    start = time.perf_counter()
    tokens = asyncio.run(serve(llm, requests, args.clients))
    wall = time.perf_counter() - start
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches
    where = "the main thread" if args.build_in == "main" else "a thread that ended"
    print(f"engine built in {where}: {tokens / wall:.1f} output tokens/s ({tokens} tokens in {wall:.1f} s), "
          f"{switches} voluntary context switches")


if __name__ == "__main__":
    main()
