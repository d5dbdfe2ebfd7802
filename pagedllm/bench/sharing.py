"""`pagedllm bench sharing`: the vLLM paper's KV block sharing results (sections 6.3-6.4): KV memory saved by parallel
sampling and beam search, and the throughput of a shared prefix with the prefix cache on vs off."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.bench.datasets import few_shot_workload, stdlib_docstrings, text_prompts
from pagedllm.bench.results import write_json
from pagedllm.config import EngineConfig, fixed_step_budget
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine, StepRecord
    from pagedllm.entrypoints.llm import LLM


# Prompt lengths in tokens, drawn uniformly: means 19 (Alpaca's) and 161 (ShareGPT's), as in the paper's table 1.
SHARING_DATASETS = {"alpaca": (10, 28), "sharegpt": (60, 262)}


class BlockUsage:
    """Blocks in use (cached-but-free blocks count as free) at every engine step, as the step's forward pass held them
    (after `step()` returns, the blocks of beam search's one-token requests would already be released)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.samples: list[int] = []

    def __enter__(self) -> BlockUsage:
        self.engine.add_step_observer(self.record)
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.remove_step_observer(self.record)

    def record(self, step: StepRecord) -> None:
        self.samples.append(step.blocks_in_use)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0


class PrefixCaching:
    """Run with the prefix cache on or off, from an empty cache, restoring the setting after: one loaded model
    serves every run."""

    def __init__(self, engine: LLMEngine, enabled: bool) -> None:
        self.engine, self.enabled = engine, enabled

    def __enter__(self) -> PrefixCaching:
        self.saved = self.engine.enable_prefix_caching
        self.engine.reset_prefix_cache()
        self.engine.enable_prefix_caching = self.enabled
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.enable_prefix_caching = self.saved
        self.engine.reset_prefix_cache()


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


def beam_search(llm: LLM, prompts: list[list[int]], width: int, max_tokens: int) -> dict:
    """LLM.beam_search with the prefix cache on (beams share their common full blocks) and off (every beam holds
    its whole context). `llm`'s budget lets all of a beam step's one-token requests run in one engine step
    (beam_llm), so each sample is one beam step in both modes."""
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    best: dict[bool, list[list[int]]] = {}

    def run(caching: bool) -> int:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        best[caching] = [o.sequences[0].tokens for o in outs]
        return sum(len(s.tokens) - len(p) for o, p in zip(outs, prompts) for s in o.sequences)

    results = {caching: measured_run(llm.engine, functools.partial(run, caching), caching)
               for caching in (True, False)}
    return {"width": width, "shared": results[True], "unshared": results[False],
            "saved_fraction": saved(results[True], results[False]), "same_best_beams": best[True] == best[False]}


def beam_llm(config: EngineConfig, prompt_sets: list[list[list[int]]], max_tokens: int) -> LLM:
    """An engine whose token budget and seats hold every beam of the widest beam search over any prompt set."""
    from pagedllm.entrypoints.llm import LLM

    width = max(SHARING_WIDTHS)
    tokens = max(width * sum(len(p) + max_tokens for p in prompts) for prompts in prompt_sets)
    seats = max(width * len(prompts) for prompts in prompt_sets)
    budget = fixed_step_budget(config.max_num_batched_tokens, tokens)
    return LLM(**vars(dataclasses.replace(config, max_num_batched_tokens=budget,
                                          max_num_seqs=max(config.max_num_seqs, seats))))


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
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.bf16_choice import torch_dtype_name

    config = EngineConfig.from_cli_args(args)
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
        "model": engine.model_name, "dtype": torch_dtype_name(config), "threads": config.num_threads,
        "block_size": config.block_size, "num_blocks": engine.stats().num_total_blocks,
        "max_num_batched_tokens": engine.max_num_batched_tokens, "max_num_seqs": config.max_num_seqs,
        "seed": args.seed, "quick": args.quick, "parts": sorted(parts), **sizes, "corpus_docstrings": len(docs),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "python": platform.python_version(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "parallel_sampling": [], "beam_search": [], "shared_prefix": [],
    }
    workloads = {}  # dataset -> (prompts, beam prompts)
    for k, (dataset, lengths) in enumerate(SHARING_DATASETS.items()):
        rng = random.Random(args.seed * 1000 + k)
        workloads[dataset] = (text_prompts(encode, texts, sizes["num_prompts"], lengths, rng),
                              text_prompts(encode, texts, sizes["beam_prompts"], lengths, rng))
    beams = beam_llm(config, [b for _, b in workloads.values()], sizes["beam_len"]) if "beam" in parts else None
    for dataset, (prompts, beam_prompts) in workloads.items():
        for n in SHARING_WIDTHS if "parallel" in parts else ():
            row = parallel_sampling(engine, prompts, n, sizes["output_len"], args.seed)
            row.update(dataset=dataset, mean_prompt_tokens=round(sum(map(len, prompts)) / len(prompts), 1))
            result["parallel_sampling"].append(row)
        for width in SHARING_WIDTHS if beams else ():
            row = beam_search(beams, beam_prompts, width, sizes["beam_len"])
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
        write_json(args.output_json, result)
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


def add_command(sub: argparse._SubParsersAction) -> None:
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
    EngineConfig.add_cli_args(sh)
    sh.set_defaults(func=cmd_sharing)
