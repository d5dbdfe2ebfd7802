"""Benchmarks. `pagedllm bench throughput`: offline throughput on a workload of pagedllm.datasets, all requests
queued at once. `pagedllm bench sharing`: the vLLM paper's KV block sharing results (parallel sampling, beam search,
shared prefix)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import time
from collections.abc import Callable

from pagedllm.datasets import (
    DATASETS,
    BenchRequest,
    describe,
    few_shot_workload,
    sample_requests,
    stdlib_docstrings,
    text_prompts,
)
from pagedllm.hf_backend import add_hf_args
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


def add_bench_commands(sub: argparse._SubParsersAction, add_engine_args: Callable) -> None:
    tp = sub.add_parser("throughput", help="offline throughput: every request queued at once")
    tp.add_argument("--dataset", default="random", choices=DATASETS,
                    help="workload (pagedllm.datasets); --seed picks its requests")
    tp.add_argument("--dataset-path", default=None, help="file dataset: JSONL of {\"prompt\", \"output_len\"} "
                                                         "or ShareGPT conversations")
    tp.add_argument("--num-prompts", type=int, default=100)
    tp.add_argument("--input-len", type=int, default=None,
                    help="mean prompt length in tokens (default: the dataset's; random 128, sharegpt 160, alpaca 19)")
    tp.add_argument("--output-len", type=int, default=None,
                    help="mean output length in tokens (default: the dataset's; random 128, sharegpt 125, alpaca 58)")
    tp.add_argument("--range-ratio", type=float, default=0.0,
                    help="random dataset: lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    tp.add_argument("--n", type=int, default=4, help="parallel-sampling dataset: samples per request")
    tp.add_argument("--beam-width", type=int, default=4, help="beam-search dataset: beams per request")
    tp.add_argument("--prefix-len", type=int, default=200, help="shared-prefix dataset: tokens of the shared prefix")
    tp.add_argument("--output-json", default=None)
    add_engine_args(tp)
    add_hf_args(tp)
    tp.set_defaults(func=cmd_throughput)

    sh = sub.add_parser("sharing", help="KV memory saved by parallel sampling and beam search, and the throughput "
                                        "of a shared prefix with the prefix cache on vs off (the vLLM paper's 6.3-6.4)")
    sh.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    sh.add_argument("--parts", default="parallel,beam,prefix", help="which experiments to run (comma-separated)")
    sh.add_argument("--num-prompts", type=int, default=8, help="parallel sampling: prompts per dataset")
    sh.add_argument("--output-len", type=int, default=96, help="parallel sampling: output tokens per sample")
    sh.add_argument("--beam-prompts", type=int, default=2, help="beam search: prompts per dataset")
    sh.add_argument("--beam-len", type=int, default=32, help="beam search: output tokens")
    sh.add_argument("--prefix-requests", type=int, default=64, help="shared prefix: requests per prefix")
    sh.add_argument("--prefix-output-len", type=int, default=32, help="shared prefix: output tokens per request")
    sh.add_argument("--output-json", default=None)
    add_engine_args(sh)
    sh.set_defaults(func=cmd_sharing)

    from pagedllm.bench_serve import add_command

    add_command(sub, add_engine_args)
    from pagedllm.bench_latency import add_command as add_latency_commands

    add_latency_commands(sub, add_engine_args)


def cmd_throughput(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config
    from pagedllm.llm import LLM

    config = engine_config(args)
    if args.backend == "hf":
        return hf_throughput(args, config)
    t_load = time.perf_counter()
    llm = LLM(**vars(config))
    load_s = time.perf_counter() - t_load
    requests = workload_requests(args, llm.get_tokenizer(), llm.engine.max_model_len)
    workload = describe(requests)
    start = time.perf_counter()
    n_out = run_workload(llm, requests)
    elapsed = time.perf_counter() - start
    n_in = sum(len(r.prompt_token_ids) for r in requests)
    result = {
        "model": llm.engine.model_name, "dtype": config.torch_dtype_name, "threads": config.num_threads,
        "dataset": args.dataset, "seed": args.seed, "workload": workload,
        "num_prompts": len(requests), "input_tokens": n_in, "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3), "load_s": round(load_s, 3),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1),
        "num_preemptions": llm.engine.scheduler.num_preemptions,
        "prefix_cache_hits": llm.engine.stats().prefix_cache_hits,
        "prefix_cache_queries": llm.engine.stats().prefix_cache_queries,
        "machine_bound": machine_bound(llm.engine, config, requests),
        "kv_policy": config.kv_policy, "batching": config.batching, "quantization": config.quantization,
        "kv_waste_fraction": round(llm.engine.stats().kv_waste_fraction, 4),
        "peak_num_running": llm.engine.stats().peak_num_running,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    return report_throughput(args, result)


def machine_bound(engine, config, requests: list[BenchRequest]) -> dict:
    """bench_latency.workload_bound at this dtype's measured matmul peak and 20 GB/s."""
    import torch

    from pagedllm.bench_latency import PEAK_GFLOPS, Machine, workload_bound

    machine = Machine(PEAK_GFLOPS[config.torch_dtype_name], 20.0)
    pairs = [(len(r.prompt_token_ids), r.output_len * max(r.n, r.beam_width, 1)) for r in requests]
    return workload_bound(engine.model_config, getattr(torch, config.torch_dtype_name), pairs, machine,
                          int4=engine.runner.model.num_int4_matmuls > 0)


def hf_throughput(args: argparse.Namespace, config) -> int:
    """The same workload on Hugging Face transformers (pagedllm.hf_backend), continuous batching sized with the
    engine's options."""
    from pagedllm.hf_backend import ENGINE_OPTIONS, run_hf
    from pagedllm.loader import load_tokenizer

    requests = workload_requests(args, load_tokenizer(config.model), config.max_model_len)
    if any(r.n > 1 or r.beam_width for r in requests):
        raise ValueError("--backend hf runs single-sample greedy requests only (not parallel sampling or beam search)")
    result = run_hf(requests, config.model, config.dtype, args.hf_mode, args.hf_batch_size, config.threads,
                    **{k: getattr(config, k) for k in ENGINE_OPTIONS})
    result.update(dataset=args.dataset, seed=args.seed, workload=describe(requests))
    return report_throughput(args, result)


def workload_requests(args: argparse.Namespace, tokenizer, max_model_len: int | None) -> list[BenchRequest]:
    return sample_requests(args.dataset, tokenizer, args.num_prompts, args.seed, dataset_path=args.dataset_path,
                           input_len=args.input_len, output_len=args.output_len, max_model_len=max_model_len,
                           n=args.n, beam_width=args.beam_width, prefix_len=args.prefix_len,
                           range_ratio=args.range_ratio)


def report_throughput(args: argparse.Namespace, result: dict) -> int:
    inp, out = result["workload"]["input_len"], result["workload"]["output_len"]
    print(f"Workload: {args.dataset}, {result['num_prompts']} requests, prompts mean {inp['mean']} / median "
          f"{inp['median']} / p90 {inp['p90']} tokens, outputs mean {out['mean']} / median {out['median']} / p90 "
          f"{out['p90']}")
    bound = result.get("machine_bound")
    if bound:
        print(f"Machine-limit estimate ({bound['peak_gflops']:.0f} GFLOP/s matmul, {bound['mem_gbps']:.0f} GB/s): "
              f"{bound['output_tokens_per_s']} output tokens/s (compute {bound['compute_s']} s + KV reads "
              f"{bound['kv_read_s']} s; longest output's steps {bound['longest_output_steps_s']} s); this run: "
              f"{result['output_tokens_per_s'] / bound['output_tokens_per_s']:.0%}")
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['output_tokens_per_s']:.1f} output tokens/s, {result['total_tokens_per_s']:.1f} total tokens/s "
          f"({result['input_tokens']} prompt + {result['output_tokens']} output tokens in {result['elapsed_s']:.1f} s)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def run_workload(llm, requests: list[BenchRequest]) -> int:
    """Run every request with ignore_eos and max_tokens = its output length; the number of tokens generated
    (every sample, every final beam). Sampling requests are queued at once (greedy if n == 1, temperature 1 for
    parallel samples); beam-search requests then run through LLM.beam_search, one call per (width, length)."""
    sampled = [r for r in requests if not r.beam_width]
    outs = llm.generate([{"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids} for r in sampled],
                        [SamplingParams(n=r.n, temperature=0.0 if r.n == 1 else 1.0, max_tokens=r.output_len,
                                        ignore_eos=True) for r in sampled], use_tqdm=True) if sampled else []
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    groups: dict[tuple[int, int], list[BenchRequest]] = {}
    for r in requests:
        if r.beam_width:
            groups.setdefault((r.beam_width, r.output_len), []).append(r)
    for (width, length), group in groups.items():
        beams = llm.beam_search([{"prompt_token_ids": r.prompt_token_ids} for r in group],
                                BeamSearchParams(beam_width=width, max_tokens=length, ignore_eos=True))
        n_out += sum(len(s.tokens) - len(r.prompt_token_ids) for o, r in zip(beams, group) for s in o.sequences)
    return n_out


# ---- bench sharing: the vLLM paper's KV block sharing results (sec. 6.3-6.4) ---------------------------------------

# Prompt lengths in tokens, drawn uniformly: means 19 (Alpaca's) and 161 (ShareGPT's), as in the paper's table 1.
SHARING_DATASETS = {"alpaca": (10, 28), "sharegpt": (60, 262)}


class BlockUsage:
    """Blocks in use (cached-but-free blocks count as free), sampled at every engine step right after the scheduler
    has allocated that step's blocks, i.e. what the step's forward pass holds. (Sampling after `step()` returns
    would miss the one-token requests of beam search, whose blocks are already released by then.)"""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.samples: list[int] = []

    def __enter__(self) -> BlockUsage:
        scheduler, pool = self.engine.scheduler, self.engine.block_manager.pool
        schedule = scheduler.schedule

        def schedule_and_sample():
            plan = schedule()
            if not plan.is_empty:
                self.samples.append(pool.num_used)
            return plan

        scheduler.schedule = schedule_and_sample
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.scheduler.schedule

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0


class PrefixCaching:
    """Run with the prefix cache on or off, from an empty cache, restoring the setting after: one loaded model
    serves every run. The cache is emptied by taking every free block (evicting its contents) and giving it back."""

    def __init__(self, engine, enabled: bool) -> None:
        self.block_manager, self.enabled = engine.block_manager, enabled

    def __enter__(self) -> PrefixCaching:
        self.saved = self.block_manager.enable_prefix_caching
        self.clear()
        self.block_manager.enable_prefix_caching = self.enabled
        return self

    def __exit__(self, *exc) -> None:
        self.block_manager.enable_prefix_caching = self.saved
        self.clear()

    def clear(self) -> None:
        pool = self.block_manager.pool
        for block_id in [pool.take() for _ in range(pool.num_free)]:
            pool.release(block_id)


def measured_run(engine, run: Callable[[], int], caching: bool) -> dict:
    """Time `run` (it returns the number of output tokens) with the prefix cache on or off; blocks in use per step,
    and the preemptions, copy-on-write copies and prefix cache figures of this run alone."""
    before = engine.stats()
    with PrefixCaching(engine, caching), BlockUsage(engine) as usage:
        start = time.perf_counter()
        output_tokens = run()
        elapsed = time.perf_counter() - start
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {"mean_blocks_in_use": round(usage.mean, 1), "peak_blocks_in_use": max(usage.samples, default=0),
            "steps": len(usage.samples), "elapsed_s": round(elapsed, 3), "output_tokens": output_tokens,
            "preemptions": after.preemptions - before.preemptions, "cow_copies": after.cow_copies - before.cow_copies,
            "prefix_cache_hit_rate": round(hits / queries, 3) if queries else 0.0}


def run_requests(engine, requests: list[tuple[list[int], SamplingParams]]) -> int:
    """Queue every request, step the engine until all are done; the number of output tokens."""
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"bench-sharing-{i}", ids, params)
    output_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                output_tokens += sum(len(c.token_ids) for c in out.outputs)
    return output_tokens


def saved(shared: dict, unshared: dict) -> float:
    return round(1 - shared["mean_blocks_in_use"] / unshared["mean_blocks_in_use"], 4)


def parallel_sampling(engine, prompts: list[list[int]], n: int, output_len: int, seed: int) -> dict:
    """Each prompt sampled n times: one request with n samples sharing the prompt's blocks, against n independent
    requests (prefix cache off in both, so the only sharing is the fork). Sample i of a request draws from seed + i
    in both modes, so the two produce the same tokens."""
    def params(j: int, samples: int, i: int = 0) -> SamplingParams:
        return SamplingParams(n=samples, temperature=1.0, max_tokens=output_len, ignore_eos=True,
                              seed=seed + 100 * j + i)

    shared = measured_run(engine, lambda: run_requests(engine, [(p, params(j, n)) for j, p in enumerate(prompts)]),
                          caching=False)
    unshared = measured_run(engine, lambda: run_requests(
        engine, [(p, params(j, 1, i)) for j, p in enumerate(prompts) for i in range(n)]), caching=False)
    return {"n": n, "shared": shared, "unshared": unshared, "saved_fraction": saved(shared, unshared)}


def beam_search(llm, prompts: list[list[int]], width: int, max_tokens: int) -> dict:
    """LLM.beam_search with the prefix cache on (beams share their common full blocks) and off (every beam holds
    its whole context). All of a beam step's one-token requests run in one engine step (budget raised), so each
    sample is one beam step in both modes."""
    scheduler = llm.engine.scheduler
    budget, max_seqs = scheduler.max_num_batched_tokens, scheduler.max_num_seqs
    scheduler.max_num_batched_tokens = max(budget, width * sum(len(p) + max_tokens for p in prompts))
    scheduler.max_num_seqs = max(max_seqs, width * len(prompts))
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    best: dict[bool, list[list[int]]] = {}

    def run(caching: bool) -> int:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        best[caching] = [o.sequences[0].tokens for o in outs]
        return sum(len(s.tokens) - len(p) for o, p in zip(outs, prompts) for s in o.sequences)

    try:
        results = {caching: measured_run(llm.engine, functools.partial(run, caching), caching)
                   for caching in (True, False)}
    finally:
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs = budget, max_seqs
    return {"width": width, "shared": results[True], "unshared": results[False],
            "saved_fraction": saved(results[True], results[False]), "same_best_beams": best[True] == best[False]}


def shared_prefix(llm, prefix: list[int], questions: list[list[int]], output_len: int) -> dict:
    """Every request is the few-shot prefix plus its own question, all queued at once; prefix cache on vs off."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    requests = [(prefix + q, params) for q in questions]
    runs = {}
    for caching in (False, True):
        run = measured_run(llm.engine, lambda: run_requests(llm.engine, requests), caching)
        run["requests_per_s"] = round(len(requests) / run["elapsed_s"], 3)
        run["output_tokens_per_s"] = round(run["output_tokens"] / run["elapsed_s"], 1)
        runs[caching] = run
    return {"prefix_tokens": len(prefix), "num_requests": len(requests),
            "mean_question_tokens": round(sum(map(len, questions)) / len(questions), 1), "output_len": output_len,
            "cache_on": runs[True], "cache_off": runs[False],
            "speedup": round(runs[True]["requests_per_s"] / runs[False]["requests_per_s"], 2)}


PAPER = {  # the vLLM paper's figures: sec. 6.3 (OPT-13B, A100) and 6.4 (LLaMA-13B, 1-shot and 5-shot prefixes)
    ("parallel", "alpaca"): "6.1-9.8%", ("parallel", "sharegpt"): "16.2-30.5%",
    ("beam", "alpaca"): "37.6-55.2%", ("beam", "sharegpt"): "44.3-66.3%",
    ("prefix", 80): "1.67x", ("prefix", 340): "3.58x",
}
SHARING_WIDTHS = (2, 4, 6)
FEW_SHOT_PREFIX_LENS = (80, 340)  # the paper's 1-shot (80 tokens) and 5-shot (341 tokens) translation prefixes


def sharing_sizes(args: argparse.Namespace) -> dict[str, int]:
    if args.quick:
        return {"num_prompts": 2, "output_len": 16, "beam_prompts": 1, "beam_len": 6, "prefix_requests": 8,
                "prefix_output_len": 4}
    return {k: getattr(args, k) for k in ("num_prompts", "output_len", "beam_prompts", "beam_len",
                                          "prefix_requests", "prefix_output_len")}


def cmd_sharing(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config
    from pagedllm.llm import LLM

    config = engine_config(args)
    sizes = sharing_sizes(args)
    parts = set(args.parts.split(","))
    if not parts <= {"parallel", "beam", "prefix"}:
        raise ValueError(f"--parts takes parallel, beam and prefix, got {args.parts!r}")
    load_before = os.getloadavg()
    llm = LLM(**vars(config))
    engine = llm.engine
    tok = engine.tokenizer

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    docs = stdlib_docstrings()
    texts = [doc for _, doc in docs]
    llm.generate([encode(texts[0])[:8]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    result: dict = {
        "model": engine.model_name, "dtype": config.torch_dtype_name, "threads": config.num_threads,
        "block_size": config.block_size, "num_blocks": engine.block_manager.num_total_blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens, "max_num_seqs": config.max_num_seqs,
        "seed": args.seed, "quick": args.quick, "parts": sorted(parts), **sizes, "corpus_docstrings": len(docs),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "python": platform.python_version(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "parallel_sampling": [], "beam_search": [], "shared_prefix": [],
    }
    for k, (dataset, lengths) in enumerate(SHARING_DATASETS.items()):
        rng = random.Random(args.seed * 1000 + k)
        prompts = text_prompts(encode, texts, sizes["num_prompts"], lengths, rng)
        beam_prompts = text_prompts(encode, texts, sizes["beam_prompts"], lengths, rng)
        for n in SHARING_WIDTHS if "parallel" in parts else ():
            row = parallel_sampling(engine, prompts, n, sizes["output_len"], args.seed)
            row.update(dataset=dataset, mean_prompt_tokens=round(sum(map(len, prompts)) / len(prompts), 1))
            result["parallel_sampling"].append(row)
        for width in SHARING_WIDTHS if "beam" in parts else ():
            row = beam_search(llm, beam_prompts, width, sizes["beam_len"])
            row.update(dataset=dataset, mean_prompt_tokens=round(sum(map(len, beam_prompts)) / len(beam_prompts), 1))
            result["beam_search"].append(row)
    for k, prefix_len in enumerate(FEW_SHOT_PREFIX_LENS if "prefix" in parts else ()):
        rng = random.Random(args.seed * 1000 + 100 + k)
        prefix, questions = few_shot_workload(encode, docs, prefix_len, sizes["prefix_requests"], rng)
        result["shared_prefix"].append(dict(shared_prefix(llm, prefix, questions, sizes["prefix_output_len"]),
                                            target_prefix_tokens=prefix_len))
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print_sharing_tables(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def print_sharing_tables(result: dict) -> None:
    print(f"{result['model']} ({result['dtype']}), block size {result['block_size']}, {result['num_blocks']} blocks")
    if result["parallel_sampling"]:
        print_parallel_sampling(result["parallel_sampling"])
    if result["beam_search"]:
        print_beam_search(result["beam_search"])
    if result["shared_prefix"]:
        print_shared_prefix(result["shared_prefix"])


def print_parallel_sampling(rows: list[dict]) -> None:
    print("\nParallel sampling: mean KV blocks in use per step, n samples sharing the prompt vs n requests")
    print(f"{'dataset':<9} {'prompt':>6} {'n':>2} {'shared':>8} {'unshared':>8} {'saved':>7} {'paper':>11} "
          f"{'preempt':>7}")
    for r in rows:
        print(f"{r['dataset']:<9} {r['mean_prompt_tokens']:>6} {r['n']:>2} {r['shared']['mean_blocks_in_use']:>8} "
              f"{r['unshared']['mean_blocks_in_use']:>8} {r['saved_fraction']:>7.1%} "
              f"{PAPER['parallel', r['dataset']]:>11} {r['shared']['preemptions'] + r['unshared']['preemptions']:>7}")


def print_beam_search(rows: list[dict]) -> None:
    print("\nBeam search: mean KV blocks in use per beam step, prefix cache on (shared) vs off")
    print(f"{'dataset':<9} {'prompt':>6} {'w':>2} {'shared':>8} {'unshared':>8} {'saved':>7} {'paper':>11} "
          f"{'on s':>6} {'off s':>6}")
    for r in rows:
        print(f"{r['dataset']:<9} {r['mean_prompt_tokens']:>6} {r['width']:>2} {r['shared']['mean_blocks_in_use']:>8} "
              f"{r['unshared']['mean_blocks_in_use']:>8} {r['saved_fraction']:>7.1%} {PAPER['beam', r['dataset']]:>11} "
              f"{r['shared']['elapsed_s']:>6.1f} {r['unshared']['elapsed_s']:>6.1f}")


def print_shared_prefix(rows: list[dict]) -> None:
    print("\nShared few-shot prefix: throughput with the prefix cache off vs on")
    print(f"{'prefix':>6} {'reqs':>4} {'req/s off':>9} {'req/s on':>9} {'tok/s off':>9} {'tok/s on':>9} "
          f"{'hit rate':>8} {'speedup':>7} {'paper':>6}")
    for r in rows:
        off, on = r["cache_off"], r["cache_on"]
        print(f"{r['prefix_tokens']:>6} {r['num_requests']:>4} {off['requests_per_s']:>9.2f} "
              f"{on['requests_per_s']:>9.2f} {off['output_tokens_per_s']:>9.1f} {on['output_tokens_per_s']:>9.1f} "
              f"{on['prefix_cache_hit_rate']:>8.1%} {r['speedup']:>6.2f}x "
              f"{PAPER['prefix', r['target_prefix_tokens']]:>6}")
