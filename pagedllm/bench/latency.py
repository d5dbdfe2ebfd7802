"""`pagedllm bench latency`: where the time of one step goes. One batch of equal random prompts per (batch size,
context length); the prefill is timed, then decode steps, whole and split into parts (scheduling, input preparation,
linear layers, attention, ... output handling) by the engine's step timers, next to the machine's limit for the step
(weights and KV cache streamed from memory, linear FLOPs at peak matmul speed)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.bench.roofline import ASSUMED_MEM_GBPS, Machine, decode_bound, local_machine
from pagedllm.config import EngineConfig, fixed_step_budget
from pagedllm.engine.step_timers import PART_HELP, PARTS
from pagedllm.model.bf16_choice import torch_dtype_name

GIB = 1 << 30
DEFAULT_BATCH_SIZES = (1, 8, 32, 64, 128)
DEFAULT_CONTEXT_LENS = (128, 512, 2048)
QUICK_BATCH_SIZES, QUICK_CONTEXT_LENS, QUICK_STEPS = (1, 8), (32, 64), 3


# ---- bench latency -------------------------------------------------------------------------------------------------
@dataclass
class LatencyCase:
    batch: int
    ctx: int
    tokens_per_seq: int  # KV slots a sequence may fill: prompt, decodes during the others' prefill, measured steps
    kv_bytes: int  # of the whole batch's KV cache


def plan_case(batch: int, ctx: int, steps: int, warmup: int, budget: int, kv_bytes_per_token: int,
              tokens_per_step: int = 1) -> LatencyCase:
    """A sequence whose prompt is done decodes while the others still prefill: at most `tokens_per_step` tokens per
    prefill step (1 + the speculative tokens), and there are at most ceil(batch * ctx / (budget - batch)) + 1 of
    them; then as many per warm-up and timed step."""
    prefill_steps = math.ceil(batch * ctx / max(1, budget - batch)) + 1
    tokens = ctx + tokens_per_step * (prefill_steps + warmup + 2 * steps) + 2
    return LatencyCase(batch, ctx, tokens, batch * tokens * kv_bytes_per_token)


def time_steps(engine: Any, steps: int) -> tuple[float, int]:
    """Mean wall ms of `steps` engine steps, and the output tokens they made (more than one a sequence per step
    where speculation's proposals are accepted)."""
    before = engine.num_generated_tokens
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3, engine.num_generated_tokens - before


def run_case(engine: Any, case: LatencyCase, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    """Run one short request untimed; queue the batch and prefill it (timed); warm up; then time `steps` decode
    steps bare and `steps` more with the timers on: the bare run gives the step time, the timed one its parts (they
    sum to its wall time)."""
    from pagedllm.sampling_params import SamplingParams

    engine.wait_for_kv_cache()  # as bench throughput and the server: no first touch of the pool inside the clock
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    engine.add_request("latency-warmup", torch.randint(0, vocab, (8,), generator=gen).tolist(),
                       SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2))  # a first forward, untimed
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=case.tokens_per_seq - case.ctx)
    for i in range(case.batch):
        engine.add_request(f"latency-{i}", torch.randint(0, vocab, (case.ctx,), generator=gen).tolist(), params)
    start, prefill_steps, latest = time.perf_counter(), 0, {}
    while len(latest) < case.batch:  # a request's first token comes with the end of its prefill
        latest.update((out.request_id, out) for out in engine.step())
        prefill_steps += 1
    prefill_s = time.perf_counter() - start
    # each timed step attends over these (every sequence gains one token per step, the warm-up's too)
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in latest.values()) + case.batch * warmup
    time_steps(engine, warmup)
    step_ms, made = time_steps(engine, steps)
    with engine.step_timers() as timers:
        timed_ms, _ = time_steps(engine, steps)
    preemptions = engine.stats().preemptions
    if engine.num_running != case.batch or preemptions:
        raise ValueError(f"batch {case.batch} x {case.ctx}: {engine.num_running} sequences running, "
                         f"{preemptions} preemptions; the KV cache is too small")
    parts = {p: timers.seconds[p] / steps * 1e3 for p in PARTS}
    parts["other"] = timed_ms - sum(parts.values())
    return {"batch": case.batch, "ctx": case.ctx, "prefill_s": round(prefill_s, 6), "prefill_steps": prefill_steps,
            "prefill_tokens_per_s": round(case.batch * case.ctx / prefill_s, 1),
            "mean_context_len": round(tokens / case.batch + (steps - 1) / 2, 1),
            "step_ms": round(step_ms, 4), "tokens_per_s": round(made / steps / step_ms * 1e3, 2),
            "timed_step_ms": round(timed_ms, 4), "parts_ms": {p: round(v, 4) for p, v in parts.items()},
            "calls_per_step": {p: timers.calls[p] / steps for p in PARTS}}


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes positive integers, got {text!r}")
    return values


def latency_sizes(args: argparse.Namespace) -> tuple[list[int], list[int], int]:
    """Batch sizes, context lengths and steps: the flags, else --quick's or the defaults."""
    batches = int_list(args.batch_sizes, "--batch-sizes") if args.batch_sizes else list(
        QUICK_BATCH_SIZES if args.quick else DEFAULT_BATCH_SIZES)
    ctxs = int_list(args.context_lens, "--context-lens") if args.context_lens else list(
        QUICK_CONTEXT_LENS if args.quick else DEFAULT_CONTEXT_LENS)
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else 10
    if steps < 1 or args.warmup_steps < 0:
        raise ValueError("--steps must be positive and --warmup-steps not negative")
    if min(args.peak_gflops or 1, args.mem_gbps or 1, args.max_kv_gib) <= 0:
        raise ValueError("--peak-gflops, --mem-gbps and --max-kv-gib must be positive")
    return batches, ctxs, steps


def machine_for(args: argparse.Namespace, dtype_name: str) -> Machine:
    """--peak-gflops as given (assumed), else this machine's measured speeds (cached; --measure-machine: afresh)."""
    if args.peak_gflops and not args.measure_machine:
        return Machine(args.peak_gflops, args.mem_gbps or ASSUMED_MEM_GBPS, source="assumed (--peak-gflops)")
    machine = local_machine(dtype_name, refresh=args.measure_machine)
    if args.mem_gbps is not None:
        machine = dataclasses.replace(machine, mem_gbps=args.mem_gbps, source=f"{machine.source}; --mem-gbps given")
    return machine


def skip_reason(case: LatencyCase, max_model_len: int, max_kv_bytes: float, pool_tokens: int | None) -> str | None:
    if case.tokens_per_seq > max_model_len:
        return f"a sequence may reach {case.tokens_per_seq} tokens, more than max_model_len {max_model_len}"
    if case.kv_bytes > max_kv_bytes:
        return f"its KV cache takes {case.kv_bytes / GIB:.2f} GiB, more than --max-kv-gib"
    if pool_tokens is not None and case.batch * case.tokens_per_seq > pool_tokens:
        return f"it needs {case.batch * case.tokens_per_seq} KV slots, the cache holds {pool_tokens}"
    return None


def kv_pool_tokens(base: Any, config: Any, dtype: torch.dtype) -> int:
    """KV slots of the cache the user sized with --num-blocks or --kv-cache-memory."""
    from pagedllm.model.model_runner import kv_bytes_per_block

    blocks = base.num_blocks or base.kv_cache_bytes // kv_bytes_per_block(config, base.block_size, dtype)
    return blocks * base.block_size


def sized_engine(base: Any, case: LatencyCase, user_sized: bool) -> Any:
    """An engine for one run: every sequence of the batch runs at once (max_num_seqs and the token budget raised to
    the batch if lower) and, unless the user sized the KV cache, a cache just large enough for the run."""
    from pagedllm.engine.llm_engine import LLMEngine

    sized = {} if user_sized else {"num_blocks": case.batch * (math.ceil(case.tokens_per_seq / base.block_size) + 1),
                                   "max_model_len": None}  # checked against the model's in skip_reason
    # Steps of one shape: asked for, every decode step speculates (the engine's gate would mix steps without drafts)
    limit = base.speculative_disable_by_batch_size or max(base.max_num_seqs, case.batch)
    budget = fixed_step_budget(base.max_num_batched_tokens, case.batch)
    return LLMEngine(dataclasses.replace(base, max_num_seqs=max(base.max_num_seqs, case.batch),
                                         max_num_batched_tokens=budget,
                                         speculative_disable_by_batch_size=limit, **sized))


def cmd_latency(args: argparse.Namespace) -> int:
    from pagedllm.config import EngineConfig
    from pagedllm.model.loader import load_config
    from pagedllm.model.model_runner import kv_bytes_per_block

    batches, ctxs, steps = latency_sizes(args)
    user_sized = args.num_blocks is not None or args.kv_cache_memory is not None
    if args.kv_cache_memory is None:
        args.kv_cache_memory = EngineConfig.kv_cache_memory
    base = EngineConfig.from_cli_args(args)
    torch.set_num_threads(base.num_threads)  # first: the dtype choice is timed, and cached, for these threads
    dtype = getattr(torch, torch_dtype_name(base))
    config = load_config(base.model)  # the shape, to size each run's KV cache before its engine
    machine = machine_for(args, torch_dtype_name(base))
    print(f"Machine: {machine.peak_gflops:.0f} GFLOP/s matmul, {machine.mem_gbps:.0f} GB/s copy ({machine.source})")
    max_model_len = min(config.max_position_embeddings, base.max_model_len or config.max_position_embeddings)
    kv_dtype = getattr(torch, base.kv_cache_torch_dtype_name)
    pool_tokens = kv_pool_tokens(base, config, kv_dtype) if user_sized else None
    result: dict[str, Any] = {
        "model": base.model or "SmolLM2-135M-Instruct (default)", "dtype": torch_dtype_name(base),
        "threads": base.num_threads, "block_size": base.block_size, "steps": steps, "warmup_steps": args.warmup_steps,
        "max_num_batched_tokens": fixed_step_budget(base.max_num_batched_tokens),
        "attention_backend": base.attention_backend,
        "quantization": base.quantization, "kv_cache_dtype": base.kv_cache_dtype,
        "num_speculative_tokens": base.num_speculative_tokens,
        "machine": {**dataclasses.asdict(machine), "cpus": os.cpu_count(), "arch": platform.machine()},
        "parts": PART_HELP, "loadavg_before": [round(x, 2) for x in os.getloadavg()], "rows": [], "skipped": []}
    for batch in batches:
        for ctx in ctxs:
            budget = fixed_step_budget(base.max_num_batched_tokens, batch)
            case = plan_case(batch, ctx, steps, args.warmup_steps, budget,
                             kv_bytes_per_block(config, 1, kv_dtype), 1 + base.num_speculative_tokens)
            reason = skip_reason(case, max_model_len, args.max_kv_gib * GIB, pool_tokens)
            if reason:
                print(f"skipping batch {batch} x context {ctx}: {reason}")
                result["skipped"].append({"batch": batch, "ctx": ctx, "reason": reason})
                continue
            engine = sized_engine(base, case, user_sized)
            row = run_case(engine, case, steps, args.warmup_steps, base.seed)
            int4 = engine.num_int4_matmuls > 0
            row.update(num_blocks=engine.stats().num_total_blocks,
                       bound=decode_bound(config, dtype, batch, row["mean_context_len"] * batch, machine, int4,
                                          kv_bytes_per_block(config, 1, kv_dtype), engine.int8_lm_head))
            del engine  # its KV cache goes before the next one is allocated
            gc.collect()
            result["rows"].append(row)
            print_latency_row(row, header=len(result["rows"]) == 1)
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return finish(args, result, plot_latency)


def finish(args: argparse.Namespace, result: dict[str, Any], plot: Callable[[dict[str, Any], str], None]) -> int:
    from pagedllm.bench.results import write_json

    if args.output_json:
        write_json(args.output_json, result)
    if args.plot and result["rows"]:
        plot(result, args.plot)
    return 0


TABLE_PARTS = {"schedule": "sched", "prepare": "prep", "linear": "linear", "rotary_kv": "rope+kv",
               "attention": "attn", "norm": "norm", "activation": "act",
               "forward_rest": "fwd rest", "logits": "logits", "sampling": "sample", "detokenize": "detok",
               "output": "output", "other": "other"}


def print_latency_row(row: dict[str, Any], header: bool) -> None:
    """One markdown row per run, printed as it finishes (the header before the first)."""
    if header:
        cols = ["batch", "ctx", "prefill s", "prefill tok/s", "step ms", "tok/s", *TABLE_PARTS.values(),
                "bound ms (linear+KV)", "bound tok/s"]
        print("decode step, ms per step; parts measured with timers on (their sum is the timed step time)")
        print("| " + " | ".join(cols) + " |\n|" + "---:|" * len(cols))
    b = row["bound"]
    cells = [row["batch"], row["ctx"], f"{row['prefill_s']:.2f}", f"{row['prefill_tokens_per_s']:.0f}",
             f"{row['step_ms']:.2f}", f"{row['tokens_per_s']:.0f}",
             *(f"{row['parts_ms'][p]:.2f}" for p in TABLE_PARTS),
             f"{b['ms']:.2f} ({b['linear_ms']:.2f}+{b['kv_ms']:.2f})", f"{b['tokens_per_s']:.0f}"]
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def plot_latency(result: dict[str, Any], path: str) -> None:
    """Stacked bars of the step's parts per (batch, context), in ms (x: the machine's bound) and in shares."""
    from pagedllm.bench.plots import pyplot

    plt = pyplot()
    rows = result["rows"]
    labels = [f"b{r['batch']}\nctx {r['ctx']}" for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.8 * len(rows) + 3), 8), sharex=True)
    colors = plt.get_cmap("tab20").colors
    for ax, share in zip(axes, (False, True)):
        bottom = [0.0] * len(rows)
        for i, part in enumerate(TABLE_PARTS):
            values = [r["parts_ms"][part] / (r["timed_step_ms"] / 100 if share else 1) for r in rows]
            ax.bar(labels, values, bottom=bottom, color=colors[i % len(colors)], label=TABLE_PARTS[part])
            bottom = [b + v for b, v in zip(bottom, values)]
        if not share:
            ax.scatter(labels, [r["bound"]["ms"] for r in rows], marker="x", color="black", zorder=3,
                       label="machine bound")
    axes[0].set_ylabel("ms per decode step")
    axes[1].set_ylabel("% of the step")
    axes[0].set_title(f"{os.path.basename(str(result['model']))}, {result['dtype']}, {result['threads']} threads")
    axes[0].legend(fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line --------------------------------------------------------------------------------------------------
def add_command(sub: argparse._SubParsersAction) -> None:
    """`pagedllm bench latency`: a decode step's time, split into parts."""
    lt = sub.add_parser("latency", help="one batch, per-step time: prefill and decode steps per batch size and "
                                        "context length, each step split into its parts, against the machine's limit")
    lt.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8,32,64,128)")
    lt.add_argument("--context-lens", default=None, help="prompt tokens, comma-separated (default 128,512,2048)")
    lt.add_argument("--steps", type=int, default=None, help="decode steps timed (default 10)")
    lt.add_argument("--warmup-steps", type=int, default=2)
    lt.add_argument("--max-kv-gib", type=float, default=8.0, help="skip runs whose KV cache would exceed this")
    lt.add_argument("--peak-gflops", type=float, default=None,
                    help="peak matmul GFLOP/s in the model's dtype (default: this machine's, measured once and cached)")
    lt.add_argument("--mem-gbps", type=float, default=None,
                    help=f"memory bandwidth, GB/s (default: this machine's copy rate, measured with the peak; "
                         f"{ASSUMED_MEM_GBPS:.0f} with --peak-gflops)")
    lt.add_argument("--measure-machine", action="store_true",
                    help="measure peak GFLOP/s (a 2048^3 matmul) and bandwidth (a large copy) afresh, not from the "
                         "cache")
    lt.add_argument("--quick", action="store_true", help=f"batch sizes {QUICK_BATCH_SIZES}, contexts "
                                                         f"{QUICK_CONTEXT_LENS}, {QUICK_STEPS} steps (a smoke test)")
    lt.add_argument("--output-json", default=None)
    lt.add_argument("--plot", default=None, help="PNG of the step's parts, stacked, per batch size and context")
    EngineConfig.add_cli_args(lt)
    # Unless --num-blocks or --kv-cache-memory is given, each run's KV cache is sized to what it needs. A decode step
    # is one token per sequence unless --num-speculative-tokens asks for speculation (random prompts make the n-gram
    # proposals of a looping output accepted, so the steps would verify 1 + k rows a sequence).
    lt.set_defaults(func=cmd_latency, kv_cache_memory=None, num_speculative_tokens=0)
