"""`pagedllm bench throughput`: offline throughput on synthetic prompts, all requests queued at once."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections.abc import Callable

from pagedllm.sampling_params import SamplingParams


def add_bench_commands(sub: argparse._SubParsersAction, add_engine_args: Callable) -> None:
    tp = sub.add_parser("throughput", help="offline throughput: every request queued at once")
    tp.add_argument("--num-prompts", type=int, default=100)
    tp.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    tp.add_argument("--output-len", type=int, default=128, help="mean output length in tokens")
    tp.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    tp.add_argument("--output-json", default=None)
    add_engine_args(tp)
    tp.set_defaults(func=cmd_throughput)


def synthetic_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                       seed: int) -> list[tuple[list[int], int]]:
    """Random-token prompts (vLLM's 'random' dataset): (prompt token ids, output length) pairs."""
    rng = random.Random(seed)

    def draw(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    # Skip the lowest ids, where special tokens live, so no prompt token is EOS or a control token.
    low = min(1000, vocab_size // 2)
    return [([rng.randrange(low, vocab_size) for _ in range(draw(input_len))], draw(output_len))
            for _ in range(num)]


def cmd_throughput(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config
    from pagedllm.llm import LLM

    config = engine_config(args)
    t_load = time.perf_counter()
    llm = LLM(**vars(config))
    load_s = time.perf_counter() - t_load
    requests = synthetic_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                  llm.engine.model_config.vocab_size, args.seed)
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    n_in = sum(len(ids) for ids, _ in requests)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "model": llm.engine.model_name, "dtype": config.torch_dtype_name, "threads": config.num_threads,
        "num_prompts": len(requests), "input_tokens": n_in, "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3), "load_s": round(load_s, 3),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1),
        "num_preemptions": llm.engine.scheduler.num_preemptions,
        "prefix_cache_hits": llm.engine.stats().prefix_cache_hits,
        "prefix_cache_queries": llm.engine.stats().prefix_cache_queries,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['output_tokens_per_s']:.1f} output tokens/s, {result['total_tokens_per_s']:.1f} total tokens/s "
          f"({n_in} prompt + {n_out} output tokens in {elapsed:.1f} s)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
