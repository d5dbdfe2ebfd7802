"""2 replicas x 1 thread (each routing policy) against 1 engine x 2 threads on this machine, the same workload, runs
alternated: output throughput and the engines' prefix hit rate (from /metrics) per configuration.

    PYTHONPATH=. python docs/scripts/data_parallel_bench.py --rounds 2 --output docs/results/data_parallel.json
    PYTHONPATH=. python docs/scripts/data_parallel_bench.py --dataset system-prompts --num-prefixes 8 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile

from pagedllm.bench.client import http_client, run_benchmark, scrape_metrics
from pagedllm.bench.datasets import BenchRequest, sample_requests
from pagedllm.bench.server_process import ServerProcess, fetch_model_card
from pagedllm.bench.summary import summarize
from pagedllm.engine.replica_pool import LOCAL_RAY_ENV
from pagedllm.model.loader import load_tokenizer

CONFIGS = {"1 engine x 2 threads": ["--threads", "2"]}
for policy in ("prefix-affinity", "least-loaded", "round-robin"):
    CONFIGS[f"2 replicas x 1 thread, {policy}"] = ["--threads", "1", "--data-parallel-size", "2", "--routing", policy]


def system_prompt_requests(tokenizer, num: int, num_prefixes: int, prefix_len: int, seed: int) -> list[BenchRequest]:
    """Several long system prompts (equally popular, in random order), each followed by a ShareGPT-like question."""
    questions = sample_requests("sharegpt", tokenizer, num, seed, input_len=60, output_len=64)
    prefixes = [r.prompt_token_ids[:prefix_len] for r in sample_requests("sharegpt", tokenizer, num_prefixes,
                                                                          seed + 1, input_len=4 * prefix_len)]
    rng = random.Random(seed)
    return [BenchRequest("", rng.choice(prefixes) + q.prompt_token_ids, q.output_len) for q in questions]


async def hit_counts(url: str) -> tuple[float, float]:
    async with http_client(url, None) as client:
        values = await scrape_metrics(client) or {}
    return values.get("pagedllm:prefix_cache_queries_total", 0.0), values.get("pagedllm:prefix_cache_hits_total", 0.0)


def run(name: str, argv: list[str], requests: list[BenchRequest], log_dir: str) -> dict:
    env = {**os.environ, **LOCAL_RAY_ENV}
    with ServerProcess(argv, os.path.join(log_dir, name.replace(" ", "_").replace(",", "") + ".log"), 900,
                       env) as server:
        model = fetch_model_card(server.url)["id"]
        asyncio.run(run_benchmark(server.url, model, requests[:4], [0.0] * 4))  # warm-up (and first compile)
        q0, h0 = asyncio.run(hit_counts(server.url))
        result = summarize(asyncio.run(run_benchmark(server.url, model, requests, [0.0] * len(requests),
                                                     sample_interval=0)), float("inf"))
        asyncio.run(asyncio.sleep(2.5))  # the replicas' counters reach /metrics with their next health check
        q1, h1 = asyncio.run(hit_counts(server.url))
    row = {"config": name, "output_tokens_per_s": result["output_tokens_per_s"],
           "requests_per_s": result["requests_per_s"], "num_failed": result["num_failed"],
           "prefix_hit_rate": round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else None,
           "median_ttft_s": result["median_ttft_s"], "p99_ttft_s": result["p99_ttft_s"],
           "loadavg_before": result["loadavg_before"], "loadavg_after": result["loadavg_after"]}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dataset", default="shared-prefix", choices=["shared-prefix", "system-prompts"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=400)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--configs", default=None, help="comma-separated subset of the configuration names' indices")
    p.add_argument("--server-args", default="--kv-cache-memory 1GiB --max-num-seqs 64",
                   help="flags every server gets")
    p.add_argument("--blocks-per-replica", type=int, default=None,
                   help="KV blocks of each replica; the single engine gets twice as many (the same memory)")
    p.add_argument("--seqs-per-replica", type=int, default=None,
                   help="--max-num-seqs of each replica; the single engine gets twice as many")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    tokenizer = load_tokenizer(None)
    if args.dataset == "shared-prefix":
        requests = sample_requests("shared-prefix", tokenizer, args.num_prompts, 0, prefix_len=args.prefix_len)
    else:
        requests = system_prompt_requests(tokenizer, args.num_prompts, args.num_prefixes, args.prefix_len, 0)
    names = list(CONFIGS)
    if args.configs:
        names = [names[int(i)] for i in args.configs.split(",")]
    log_dir = tempfile.mkdtemp(prefix="pagedllm-dp-bench-")
    rows = []
    for r in range(args.rounds):  # alternate: every configuration once per round, the order reversed every other
        for name in names if r % 2 == 0 else names[::-1]:
            argv = [*args.server_args.split(), *CONFIGS[name]]
            if args.blocks_per_replica:
                argv += ["--num-blocks", str(args.blocks_per_replica * (1 if "replicas" in name else 2))]
            if args.seqs_per_replica:
                argv += ["--max-num-seqs", str(args.seqs_per_replica * (1 if "replicas" in name else 2))]
            rows.append({"round": r, **run(name, argv, requests, log_dir)})
    result = {"dataset": args.dataset, "num_prompts": args.num_prompts, "prefix_len": args.prefix_len,
              "num_prefixes": args.num_prefixes if args.dataset == "system-prompts" else 1,
              "server_args": args.server_args, "blocks_per_replica": args.blocks_per_replica,
              "seqs_per_replica": args.seqs_per_replica, "cpus": os.cpu_count(),
              "rows": rows}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    print("| configuration | round | output tok/s | prefix hit rate | median TTFT s | load before |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['round']} | {row['output_tokens_per_s']} | {row['prefix_hit_rate']} | "
              f"{row['median_ttft_s']} | {row['loadavg_before']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
