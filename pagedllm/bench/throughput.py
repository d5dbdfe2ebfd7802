"""`pagedllm bench throughput`: offline throughput on a workload of pagedllm.bench.datasets, all requests queued at
once (or the same workload on Hugging Face transformers with --backend hf)."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time

from pagedllm.bench.breakdown import BreakdownRecorder, print_breakdown
from pagedllm.bench.datasets import (
    DATASETS,
    BenchRequest,
    describe,
    sample_requests,
    save_workload,
)
from pagedllm.bench.hf_backend import add_hf_args
from pagedllm.bench.results import write_json
from pagedllm.bench.sampling_flags import add_sampling_args, sampling_overrides
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.kv_trace import TraceRecorder
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


def cmd_throughput(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.bf16_choice import torch_dtype_name

    config = EngineConfig.from_cli_args(args)
    if args.backend == "hf":
        return hf_throughput(args, config)
    t_load = time.perf_counter()
    llm = LLM(**vars(config))
    llm.engine.wait_for_kv_cache()  # the pool mapped before the clock starts (counted in load_s)
    load_s = time.perf_counter() - t_load
    requests = workload_requests(args, llm.get_tokenizer(), llm.engine.max_model_len)
    if args.save_workload:
        save_workload(requests, args.save_workload)
    workload = describe(requests)
    trace = None
    if args.trace:  # recorded inside the timed run: its cost is part of the figure
        trace = TraceRecorder(llm.engine, args.trace, every=args.trace_every, kv_policy=config.kv_policy,
                              batching=config.batching, dataset=args.dataset, num_prompts=len(requests))
        llm.engine.add_step_observer(trace)
    recorder = BreakdownRecorder(llm.engine) if args.breakdown else contextlib.nullcontext()
    start = time.perf_counter()
    with recorder:
        n_out = run_workload(llm, requests, sampling_overrides(args))
    if trace is not None:
        trace.close()
        llm.engine.remove_step_observer(trace)
    elapsed = time.perf_counter() - start
    if trace is not None:
        print(f"Trace: {args.trace}, {trace.frames} frames of {trace.steps} steps, "
              f"{os.path.getsize(args.trace) / 1e6:.1f} MB (`pagedllm replay {args.trace}` shows it)")
    n_in = sum(len(r.prompt_token_ids) for r in requests)
    stats = llm.engine.stats()
    result = {
        "model": llm.engine.model_name, "dtype": torch_dtype_name(config), "threads": config.num_threads,
        "max_num_batched_tokens": llm.engine.max_num_batched_tokens,
        "dataset": args.dataset, "seed": args.seed, "workload": workload, "sampling": sampling_overrides(args),
        "num_prompts": len(requests), "input_tokens": n_in, "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3), "load_s": round(load_s, 3),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1),
        "num_preemptions": stats.preemptions,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "spec_draft_tokens": stats.spec_draft_tokens, "spec_accepted_tokens": stats.spec_accepted_tokens,
        "spec_gate": stats.spec_gate,
        "machine_bound": machine_bound(llm.engine, config, requests),
        "kv_policy": config.kv_policy, "batching": config.batching, "quantization": config.quantization,
        "kv_waste_fraction": round(stats.kv_waste_fraction, 4),
        "peak_num_running": stats.peak_num_running,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    if args.breakdown:
        result["breakdown"] = recorder.result.as_dict()
        print_breakdown(recorder.result)
    return report_throughput(args, result)


def machine_bound(engine, config, requests: list[BenchRequest]) -> dict:
    """roofline.workload_bound at this machine's peak matmul rate in the dtype and its copy bandwidth (measured here
    once, then cached); measured after the timed run, so it is not part of it."""
    import torch

    from pagedllm.bench.roofline import local_machine, workload_bound
    from pagedllm.model.bf16_choice import torch_dtype_name
    from pagedllm.model.model_runner import kv_bytes_per_block

    machine = local_machine(torch_dtype_name(config))
    pairs = [(len(r.prompt_token_ids), r.output_len * max(r.n, r.beam_width, 1)) for r in requests]
    kv_dtype = getattr(torch, config.kv_cache_torch_dtype_name)
    scheduler = config.scheduler_config
    return workload_bound(engine.model_config, getattr(torch, torch_dtype_name(config)), pairs, machine,
                          int4=engine.num_int4_matmuls > 0,
                          kv_bytes_per_token=kv_bytes_per_block(engine.model_config, 1, kv_dtype),
                          tokens_per_step=1 + (scheduler.num_speculative_tokens if scheduler.speculates else 0),
                          int8_head=engine.int8_lm_head)


def hf_throughput(args: argparse.Namespace, config) -> int:
    """The same workload on Hugging Face transformers (pagedllm.bench.hf_backend), continuous batching sized with the
    engine's options."""
    from pagedllm.bench.hf_backend import ENGINE_OPTIONS, run_hf
    from pagedllm.model.loader import load_tokenizer

    if args.breakdown:
        raise ValueError("--breakdown times pagedllm's own steps; it does not apply to --backend hf")
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
    if bound and bound["output_tokens_per_s"] > 0:  # 0: a peak too low to count (bf16 emulated where it is slow)
        print(f"Machine-limit estimate ({bound['peak_gflops']:.0f} GFLOP/s matmul, {bound['mem_gbps']:.0f} GB/s copy; "
              f"{bound['source']}): "
              f"{bound['output_tokens_per_s']} output tokens/s (compute {bound['compute_s']} s + KV reads "
              f"{bound['kv_read_s']} s; longest output's steps {bound['longest_output_steps_s']} s); this run: "
              f"{result['output_tokens_per_s'] / bound['output_tokens_per_s']:.0%}")
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['output_tokens_per_s']:.1f} output tokens/s, {result['total_tokens_per_s']:.1f} total tokens/s "
          f"({result['input_tokens']} prompt + {result['output_tokens']} output tokens in {result['elapsed_s']:.1f} s)")
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def run_workload(llm, requests: list[BenchRequest], overrides: dict[str, float | int] | None = None) -> int:
    """Run every request with ignore_eos and max_tokens = its output length; the number of tokens generated
    (every sample, every final beam). Sampling requests are queued at once (greedy if n == 1, temperature 1 for
    parallel samples, unless `overrides` set the sampling); beam-search requests then run through
    LLM.beam_search, one call per (width, length)."""
    sampled = [r for r in requests if not r.beam_width]
    params = [SamplingParams(n=r.n, max_tokens=r.output_len, ignore_eos=True,
                             **{"temperature": 0.0 if r.n == 1 else 1.0, **(overrides or {})}) for r in sampled]
    outs = llm.generate([{"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids} for r in sampled], params,
                        use_tqdm=True) if sampled else []
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    groups: dict[tuple[int, int], list[BenchRequest]] = {}
    for r in requests:
        if r.beam_width:
            groups.setdefault((r.beam_width, r.output_len), []).append(r)
    for (width, length), group in groups.items():
        beams = llm.beam_search([{"prompt_token_ids": r.prompt_token_ids} for r in group],
                                BeamSearchParams(beam_width=width, max_tokens=length, ignore_eos=True), use_tqdm=True)
        n_out += sum(len(s.tokens) - len(r.prompt_token_ids) for o, r in zip(beams, group) for s in o.sequences)
    return n_out


def add_command(sub: argparse._SubParsersAction) -> None:
    tp = sub.add_parser("throughput", help="offline throughput: every request queued at once")
    tp.add_argument("--dataset", default="random", choices=DATASETS,
                    help="workload (pagedllm.bench.datasets); --seed picks its requests")
    tp.add_argument("--dataset-path", default=None, help="file dataset: JSONL of {\"prompt\" or "
                    "\"prompt_token_ids\", \"output_len\"} or ShareGPT conversations")
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
    add_sampling_args(tp)
    tp.add_argument("--output-json", default=None)
    tp.add_argument("--save-workload", default=None, metavar="PATH", help="write the sampled requests as JSONL "
                    '({"prompt_token_ids", "output_len"}), to run the same requests on another engine')
    tp.add_argument("--trace", default=None, metavar="PATH", help="record the KV cache (snapshots of the block pool, "
                    "block tables, events) as JSONL, for `pagedllm replay PATH`")
    tp.add_argument("--breakdown", action="store_true", help="time the run by part of the step (matmuls, attention, "
                    "lm_head, scheduling, ...) and by step size, and print both (the timers slow the run a little)")
    tp.add_argument("--trace-every", type=int, default=8, metavar="K", help="--trace: a snapshot every K steps")
    EngineConfig.add_cli_args(tp)
    add_hf_args(tp)
    tp.set_defaults(func=cmd_throughput)
