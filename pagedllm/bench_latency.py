"""Latency benchmarks: where the time of one decode step goes, and what paging costs the attention kernel.

`pagedllm bench latency`: one batch of equal random prompts per (batch size, context length); the prefill is timed,
then decode steps, whole and split into parts (scheduling, input preparation, linear layers, attention, ... output
handling) by perf_counter wrappers that are installed around the engine's functions for the run only, next to the
machine's limit for the step (weights and KV cache streamed from memory, linear FLOPs at peak matmul speed).
`pagedllm bench attention`: the paged C++ kernel against the same kernel over consecutive blocks (the cost of the
paging indirection itself), the plain-PyTorch reference and PyTorch SDPA over a dense, non-paged cache, on the same
keys and values (the vLLM paper's "paging makes the kernel 20-26% slower" question).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers import INT4_MAX_ROWS, Int4Weight

GIB = 1 << 30
DEFAULT_BATCH_SIZES = (1, 8, 32, 64, 128)
DEFAULT_CONTEXT_LENS = (128, 512, 2048)
QUICK_BATCH_SIZES, QUICK_CONTEXT_LENS, QUICK_STEPS = (1, 8), (32, 64), 3
# Peak matmul GFLOP/s measured on this project's machine (2 vCPUs of an AMD EPYC, AVX512-BF16, no AMX): 2048^3.
PEAK_GFLOPS = {"bfloat16": 390.0, "float32": 190.0}

# The parts of a decode step, in the order a step runs them; "other" is the step's wall time minus their sum.
PARTS = ("schedule", "prepare", "linear", "rotary", "kv_write", "attention", "norm", "activation", "forward_rest",
         "logits", "sampling", "detokenize", "output")
PART_HELP = {
    "schedule": "scheduler.schedule + commit", "prepare": "model_runner.prepare (batch tensors)",
    "linear": "the decoder layers' matmuls (layers.linear)", "rotary": "model.rotary", "kv_write": "write_kv",
    "attention": "paged_attention", "norm": "add_rms_norm", "activation": "swiglu",
    "forward_rest": "the rest of model.forward (embedding, views, the layer loop)",
    "logits": "model.compute_logits / top_logits (lm_head)", "sampling": "SamplingBatch.build + sample",
    "detokenize": "incremental detokenizer", "output": "engine._process_token (minus detokenize), _output",
    "other": "step wall time minus every part above",
}


# ---- timers around a step ------------------------------------------------------------------------------------------
class _Delegate:
    """Stands in for a module or class: the given attributes replaced, every other one read from `target`."""

    def __init__(self, target: Any, **overrides: Any) -> None:
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class StepTimers:
    """perf_counter wrappers around what an engine step calls, installed on enter and removed on exit, so the
    engine's hot path carries no timing code. Times are exclusive: a timed call inside another counts only for
    itself (model.forward's part is what its timed calls leave), except inside model.compute_logits, which takes
    its lm_head matmul along (an opaque part)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(PARTS, 0)
        self._nested: list[float] = []  # per open timed call: seconds spent in timed calls inside it
        self._opaque = 0  # > 0 inside an opaque part: timed calls there just run
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> StepTimers:
        from pagedllm import llama, model_runner
        from pagedllm.tokenizer import IncrementalDetokenizer

        engine, model = self.engine, self.engine.runner.model
        for name, part in (("linear", "linear"), ("paged_attention", "attention"), ("write_kv", "kv_write"),
                           ("add_rms_norm", "norm"), ("swiglu", "activation")):
            self._wrap(llama, name, part)
        self._wrap(model, "forward", "forward_rest")
        self._wrap(model, "rotary", "rotary")
        self._wrap(model, "compute_logits", "logits", opaque=True)
        self._wrap(model, "top_logits", "logits", opaque=True)  # the greedy path's logits
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "commit", "schedule")
        self._wrap(engine.runner, "prepare", "prepare")
        self._wrap(model_runner, "sample", "sampling")
        batch_cls = model_runner.SamplingBatch
        self._set(model_runner, "SamplingBatch", _Delegate(batch_cls, build=self._timed("sampling", batch_cls.build)))
        self._wrap(IncrementalDetokenizer, "step", "detokenize")
        for name in ("_process_token", "_release_finished", "_output"):
            self._wrap(engine, name, "output")
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _UNSET:
                delattr(owner, name)  # the instance attribute goes; its class's method shows again
            else:
                setattr(owner, name, original)

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name) if name in vars(owner) else _UNSET))
        setattr(owner, name, value)

    def _wrap(self, owner: Any, name: str, part: str, opaque: bool = False) -> None:
        self._set(owner, name, self._timed(part, getattr(owner, name), opaque))

    def _timed(self, part: str, fn: Callable, opaque: bool = False) -> Callable:
        perf_counter, nested = time.perf_counter, self._nested

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._opaque:
                return fn(*args, **kwargs)
            nested.append(0.0)
            self._opaque += opaque
            start = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = perf_counter() - start
                self._opaque -= opaque
                self.seconds[part] += elapsed - nested.pop()
                self.calls[part] += 1
                if nested:
                    nested[-1] += elapsed

        return timed


_UNSET = object()


# ---- the machine's limit -------------------------------------------------------------------------------------------
@dataclass
class Machine:
    peak_gflops: float  # matmul, in the model's dtype
    mem_gbps: float  # memory bandwidth (bytes read + written per second)
    measured: dict[str, float] | None = None  # what --measure-machine found


def call_times(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure_machine(size: int = 2048, copy_bytes: int = 512 << 20, repeats: int = 3) -> dict[str, float]:
    """Best-of-`repeats` GFLOP/s of a size^3 matmul in bf16 and fp32, and GB/s of a large tensor copy
    (read + write), with torch's current threads."""
    def best(fn: Callable[[], object]) -> float:
        return min(call_times(fn, repeats))

    result = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        result[f"{name}_gflops"] = round(2 * size ** 3 / best(lambda a=a, b=b: a @ b) / 1e9, 1)
    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)
    result["copy_gbps"] = round(2 * copy_bytes / best(lambda: dst.copy_(src)) / 1e9, 1)
    return result


def layer_params(config: Any) -> int:
    """Weights of every layer's linear projections (qkv, o, gate_up, down): what a decode step reads besides the
    lm_head."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return config.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def weight_bytes(config: Any, dtype: torch.dtype, int4: bool) -> float:
    """Bytes a step reads for the weights: the layers' in 4 bits plus a scale and min per group when the int4
    kernel serves them, else in the dtype; the lm_head always in the dtype."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_weight = Int4Weight.BYTES_PER_WEIGHT if int4 else elem
    return layer_params(config) * per_weight + config.vocab_size * config.hidden_size * elem


def decode_bound(config: Any, dtype: torch.dtype, batch: int, context_tokens: float, machine: Machine,
                 int4: bool = False) -> dict[str, float]:
    """The fastest a decode step of `batch` sequences holding `context_tokens` tokens in all can run here: every
    linear weight (lm_head included) read once or its FLOPs at peak, whichever is slower, plus the KV cache read.
    `int4`: the engine has 4-bit layer weights, which it reads instead at up to INT4_MAX_ROWS rows."""
    elem = torch.empty((), dtype=dtype).element_size()
    params = layer_params(config) + config.vocab_size * config.hidden_size
    weights, flops = weight_bytes(config, dtype, int4 and batch <= INT4_MAX_ROWS), 2 * batch * params
    kv_bytes = context_tokens * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * elem
    linear_ms = 1e3 * max(weights / (machine.mem_gbps * 1e9), flops / (machine.peak_gflops * 1e9))
    kv_ms = 1e3 * kv_bytes / (machine.mem_gbps * 1e9)
    return {"weight_bytes": round(weights), "linear_flops": flops, "kv_bytes": round(kv_bytes),
            "linear_ms": round(linear_ms, 4), "kv_ms": round(kv_ms, 4), "ms": round(linear_ms + kv_ms, 4),
            "tokens_per_s": round(batch / (linear_ms + kv_ms) * 1e3, 1)}


def workload_bound(config: Any, dtype: torch.dtype, requests: list[tuple[int, int]], machine: Machine,
                   int4: bool = False) -> dict:
    """A machine-limit estimate for an offline workload of (prompt tokens, output tokens) requests: every token's
    linear FLOPs (the lm_head for output tokens only) at peak, plus each decode's read of its context's K/V at memory
    bandwidth; and never less than the longest output's decode steps, each reading every weight once (4-bit layer
    weights with `int4`: the last steps run few sequences)."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers, head = layer_params(config), config.vocab_size * config.hidden_size
    prompt, output = sum(p for p, _ in requests), sum(o for _, o in requests)
    flops = 2 * layers * (prompt + output) + 2 * head * output
    kv_token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * elem
    kv_read = sum(o * p + o * (o - 1) // 2 for p, o in requests) * kv_token_bytes  # context read per decode
    compute_s = flops / (machine.peak_gflops * 1e9)
    kv_s = kv_read / (machine.mem_gbps * 1e9)
    steps_s = max((o for _, o in requests), default=0) * weight_bytes(config, dtype, int4) / (machine.mem_gbps * 1e9)
    bound_s = max(compute_s + kv_s, steps_s)
    return {"peak_gflops": machine.peak_gflops, "mem_gbps": machine.mem_gbps, "compute_s": round(compute_s, 2),
            "kv_read_s": round(kv_s, 2), "longest_output_steps_s": round(steps_s, 2), "bound_s": round(bound_s, 2),
            "output_tokens_per_s": round(output / bound_s, 1) if bound_s else None}


# ---- bench latency -------------------------------------------------------------------------------------------------
@dataclass
class LatencyCase:
    batch: int
    ctx: int
    tokens_per_seq: int  # KV slots a sequence may fill: prompt, decodes during the others' prefill, measured steps
    kv_bytes: int  # of the whole batch's KV cache


def plan_case(batch: int, ctx: int, steps: int, warmup: int, budget: int, kv_bytes_per_token: int) -> LatencyCase:
    """A sequence whose prompt is done decodes while the others still prefill: at most one token per prefill step,
    and there are at most ceil(batch * ctx / (budget - batch)) + 1 of them."""
    prefill_steps = math.ceil(batch * ctx / max(1, budget - batch)) + 1
    tokens = ctx + prefill_steps + warmup + 2 * steps + 2
    return LatencyCase(batch, ctx, tokens, batch * tokens * kv_bytes_per_token)


def time_steps(engine: Any, steps: int) -> float:
    """Mean wall ms of `steps` engine steps."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def run_case(engine: Any, case: LatencyCase, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    """Run one short request untimed; queue the batch and prefill it (timed); warm up; then time `steps` decode
    steps bare and `steps` more with the timers on: the bare run gives the step time, the timed one its parts (they
    sum to its wall time)."""
    from pagedllm.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    engine.add_request("latency-warmup", torch.randint(0, vocab, (8,), generator=gen).tolist(),
                       SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2))  # a first forward, untimed
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=case.tokens_per_seq - case.ctx)
    for i in range(case.batch):
        engine.add_request(f"latency-{i}", torch.randint(0, vocab, (case.ctx,), generator=gen).tolist(), params)
    start, prefill_steps = time.perf_counter(), 0
    while engine.num_waiting or not all(g.is_decoding for g in engine.scheduler.running):
        engine.step()
        prefill_steps += 1
    prefill_s = time.perf_counter() - start
    time_steps(engine, warmup)
    tokens = sum(s.num_tokens for g in engine.scheduler.running for s in g.seqs)  # each step attends over these
    step_ms = time_steps(engine, steps)
    with StepTimers(engine) as timers:
        timed_ms = time_steps(engine, steps)
    if engine.num_running != case.batch or engine.scheduler.num_preemptions:
        raise ValueError(f"batch {case.batch} x {case.ctx}: {engine.num_running} sequences running, "
                         f"{engine.scheduler.num_preemptions} preemptions; the KV cache is too small")
    parts = {p: timers.seconds[p] / steps * 1e3 for p in PARTS}
    parts["other"] = timed_ms - sum(parts.values())
    return {"batch": case.batch, "ctx": case.ctx, "prefill_s": round(prefill_s, 6), "prefill_steps": prefill_steps,
            "prefill_tokens_per_s": round(case.batch * case.ctx / prefill_s, 1),
            "mean_context_len": round(tokens / case.batch + (steps - 1) / 2, 1),
            "step_ms": round(step_ms, 4), "tokens_per_s": round(case.batch / step_ms * 1e3, 2),
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
    if min(args.peak_gflops or 1, args.mem_gbps, args.max_kv_gib) <= 0:
        raise ValueError("--peak-gflops, --mem-gbps and --max-kv-gib must be positive")
    return batches, ctxs, steps


def machine_for(args: argparse.Namespace, dtype_name: str) -> Machine:
    measured = measure_machine() if args.measure_machine else None
    if measured:
        return Machine(measured[f"{dtype_name}_gflops"], measured["copy_gbps"], measured)
    return Machine(args.peak_gflops or PEAK_GFLOPS[dtype_name], args.mem_gbps)


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
    from pagedllm.model_runner import kv_bytes_per_block

    blocks = base.num_blocks or base.kv_cache_bytes // kv_bytes_per_block(config, base.block_size, dtype)
    return blocks * base.block_size


def sized_engine(base: Any, case: LatencyCase, user_sized: bool) -> Any:
    """An engine for one run: every sequence of the batch runs at once (max_num_seqs and the token budget raised to
    the batch if lower) and, unless the user sized the KV cache, a cache just large enough for the run."""
    from pagedllm.engine import LLMEngine

    sized = {} if user_sized else {"num_blocks": case.batch * (math.ceil(case.tokens_per_seq / base.block_size) + 1),
                                   "max_model_len": None}  # checked against the model's in skip_reason
    return LLMEngine(dataclasses.replace(base, max_num_seqs=max(base.max_num_seqs, case.batch),
                                         max_num_batched_tokens=max(base.max_num_batched_tokens, case.batch), **sized))


def cmd_latency(args: argparse.Namespace) -> int:
    from pagedllm.cli import engine_config
    from pagedllm.config import EngineConfig
    from pagedllm.loader import load_model
    from pagedllm.model_runner import kv_bytes_per_block

    batches, ctxs, steps = latency_sizes(args)
    user_sized = args.num_blocks is not None or args.kv_cache_memory is not None
    if args.kv_cache_memory is None:
        args.kv_cache_memory = EngineConfig.kv_cache_memory
    base = engine_config(args)
    dtype = getattr(torch, base.torch_dtype_name)
    torch.set_num_threads(base.num_threads)
    config = load_model(base.model, dtype).config  # the shape, to size each run's KV cache before its engine
    machine = machine_for(args, base.torch_dtype_name)
    max_model_len = min(config.max_position_embeddings, base.max_model_len or config.max_position_embeddings)
    pool_tokens = kv_pool_tokens(base, config, dtype) if user_sized else None
    result: dict[str, Any] = {
        "model": base.model or "SmolLM2-135M-Instruct (default)", "dtype": base.torch_dtype_name,
        "threads": base.num_threads, "block_size": base.block_size, "steps": steps, "warmup_steps": args.warmup_steps,
        "max_num_batched_tokens": base.max_num_batched_tokens, "attention_backend": base.attention_backend,
        "quantization": base.quantization,
        "machine": {**dataclasses.asdict(machine), "cpus": os.cpu_count(), "arch": platform.machine()},
        "parts": PART_HELP, "loadavg_before": [round(x, 2) for x in os.getloadavg()], "rows": [], "skipped": []}
    for batch in batches:
        for ctx in ctxs:
            case = plan_case(batch, ctx, steps, args.warmup_steps, max(base.max_num_batched_tokens, batch),
                             kv_bytes_per_block(config, 1, dtype))
            reason = skip_reason(case, max_model_len, args.max_kv_gib * GIB, pool_tokens)
            if reason:
                print(f"skipping batch {batch} x context {ctx}: {reason}")
                result["skipped"].append({"batch": batch, "ctx": ctx, "reason": reason})
                continue
            engine = sized_engine(base, case, user_sized)
            row = run_case(engine, case, steps, args.warmup_steps, base.seed)
            int4 = engine.runner.model.num_int4_matmuls > 0
            row.update(num_blocks=engine.block_manager.num_total_blocks,
                       bound=decode_bound(config, dtype, batch, row["mean_context_len"] * batch, machine, int4))
            del engine  # its KV cache goes before the next one is allocated
            gc.collect()
            result["rows"].append(row)
            print_latency_row(row, header=len(result["rows"]) == 1)
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return finish(args, result, plot_latency)


def finish(args: argparse.Namespace, result: dict[str, Any], plot: Callable[[dict[str, Any], str], None]) -> int:
    from pagedllm.bench_serve import write_json

    if args.output_json:
        write_json(args.output_json, result)
    if args.plot and result["rows"]:
        plot(result, args.plot)
    return 0


TABLE_PARTS = {"schedule": "sched", "prepare": "prep", "linear": "linear", "rotary": "rotary",
               "kv_write": "kv write", "attention": "attn", "norm": "norm", "activation": "act",
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
    from pagedllm.bench_serve import pyplot

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


# ---- bench attention -----------------------------------------------------------------------------------------------
COLD_BYTES = 128 << 20  # 4x this machine's L3: K/V spread over this many bytes of layers come from memory
HEAD_DIM, BLOCK_SIZE = 64, 16


@dataclass
class AttentionCase:
    kind: str  # "decode" (one query per sequence) or "prefill" (one sequence, causal over its whole prompt)
    lens: list[int]  # context length of each sequence
    heads: int
    kv_heads: int
    dtype: torch.dtype

    @property
    def name(self) -> str:
        ctx = f"ctx {min(self.lens)}-{max(self.lens)}" if len(set(self.lens)) > 1 else f"ctx {self.lens[0]}"
        return f"{self.kind} {len(self.lens)} seqs, {ctx}, {self.heads}/{self.kv_heads}x{HEAD_DIM}"


def attention_cases(quick: bool, gen: torch.Generator) -> list[AttentionCase]:
    """Decode: 32 sequences of ~U(100, 1000) tokens; prefill: one 512- or 2048-token prompt. The default model's
    head shape (9 query / 3 KV heads) and a plain multi-head one, fp32 and bf16. --quick: tiny sizes."""
    heads = [(4, 2)] if quick else [(9, 3), (12, 12)]
    decode_lens = torch.randint(20, 61, (4,), generator=gen) if quick else torch.randint(100, 1001, (32,),
                                                                                           generator=gen)
    prefill_lens = (32,) if quick else (512, 2048)
    cases = []
    for h, kvh in heads:
        for dtype in (torch.float32, torch.bfloat16):
            cases.append(AttentionCase("decode", decode_lens.tolist(), h, kvh, dtype))
            cases += [AttentionCase("prefill", [n], h, kvh, dtype) for n in prefill_lens]
    return cases


@dataclass
class AttentionInputs:
    """One case's queries and the same keys/values three ways, for each of `layers` layers used in turn: blocks
    scattered in random order (paging), the same blocks consecutive per sequence, and a dense padded tensor."""

    q: torch.Tensor  # [T, H, D]
    scattered: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [blocks, block, Hkv, D]
    scattered_tables: torch.Tensor  # int32 [S, max_blocks]
    consecutive: list[tuple[torch.Tensor, torch.Tensor]]
    consecutive_tables: torch.Tensor  # sequence s's blocks are offsets[s] .. offsets[s] + n_s - 1
    dense: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [S, Hkv, max_len, D]
    context_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    max_query_len: int


def attention_inputs(case: AttentionCase, gen: torch.Generator) -> AttentionInputs:
    lens = case.lens
    nblocks = [math.ceil(n / BLOCK_SIZE) for n in lens]
    total = sum(nblocks)
    elem = torch.empty((), dtype=case.dtype).element_size()
    layers = min(4, math.ceil(COLD_BYTES / (2 * total * BLOCK_SIZE * case.kv_heads * HEAD_DIM * elem)))
    offsets = [0, *torch.tensor(nblocks).cumsum(0).tolist()]
    consecutive_tables = torch.zeros(len(lens), max(nblocks), dtype=torch.int32)
    for s, n in enumerate(nblocks):
        consecutive_tables[s, :n] = torch.arange(offsets[s], offsets[s] + n)
    where = torch.randperm(total, generator=gen)  # consecutive block i lives at scattered block where[i]
    scattered_tables = where[consecutive_tables.long()].to(torch.int32)  # padding entries: any valid block
    consecutive, scattered, dense = [], [], []
    for _ in range(layers):
        kv = [torch.randn(total, BLOCK_SIZE, case.kv_heads, HEAD_DIM, generator=gen).to(case.dtype) for _ in "kv"]
        consecutive.append(tuple(kv))
        scattered.append(tuple(torch.empty_like(t).index_copy_(0, where, t) for t in kv))
        dense.append(tuple(dense_cache(t, lens, offsets) for t in kv))
    decode = case.kind == "decode"
    num_q = len(lens) if decode else lens[0]
    return AttentionInputs(
        q=torch.randn(num_q, case.heads, HEAD_DIM, generator=gen).to(case.dtype),
        scattered=scattered, scattered_tables=scattered_tables, consecutive=consecutive,
        consecutive_tables=consecutive_tables, dense=dense, context_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32) if decode else
        torch.tensor([0, lens[0]], dtype=torch.int32), max_query_len=1 if decode else lens[0])


def dense_cache(blocks: torch.Tensor, lens: list[int], offsets: list[int]) -> torch.Tensor:
    """[S, Hkv, max_len, D], zero-padded: each sequence's consecutive blocks, as SDPA wants them."""
    out = torch.zeros(len(lens), blocks.shape[2], max(lens), blocks.shape[3], dtype=blocks.dtype)
    for s, n in enumerate(lens):
        out[s, :, :n] = blocks[offsets[s]:offsets[s + 1]].flatten(0, 1)[:n].transpose(0, 1)
    return out


def attention_variants(case: AttentionCase, x: AttentionInputs) -> dict[str, Callable[[int], torch.Tensor]]:
    """Call i of each variant runs layer i mod layers; each returns [T, H, D]."""
    from pagedllm.attention import paged_attention

    scale = HEAD_DIM ** -0.5

    def paged(caches: list, tables: torch.Tensor, backend: str) -> Callable[[int], torch.Tensor]:
        return lambda i: paged_attention(x.q, *caches[i % len(caches)], tables, x.context_lens, x.query_start_loc,
                                         scale, x.max_query_len, backend)

    if case.kind == "decode":  # one query per sequence, padding keys masked off
        q4 = x.q.unsqueeze(2)  # [S, H, 1, D]
        mask = (torch.arange(max(case.lens))[None, :] < x.context_lens[:, None]).view(len(case.lens), 1, 1, -1)
        unpack = lambda o: o.squeeze(2)  # noqa: E731
    else:  # one causal sequence
        q4, mask = x.q.transpose(0, 1).unsqueeze(0), None  # [1, H, T, D]
        unpack = lambda o: o[0].transpose(0, 1)  # noqa: E731

    def sdpa(i: int) -> torch.Tensor:
        k, v = x.dense[i % len(x.dense)]
        return unpack(F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                     enable_gqa=True))

    return {"cpp": paged(x.scattered, x.scattered_tables, "cpp"),
            "cpp_consecutive": paged(x.consecutive, x.consecutive_tables, "cpp"),
            "reference": paged(x.scattered, x.scattered_tables, "reference"), "sdpa": sdpa}


def median_ms(variants: dict[str, Callable[[int], object]], repeats: int) -> dict[str, float]:
    """Round-robin over the variants, so background load hits them alike; round 0 warms up. The slow reference
    runs only in the first few rounds."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeats + 1):
        for name, fn in variants.items():
            if name == "reference" and i > max(2, repeats // 5):
                continue
            start = time.perf_counter()
            fn(i)
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def bench_attention(threads: int | None = None, repeats: int = 15, quick: bool = False,
                    seed: int = 0) -> list[dict[str, Any]]:
    """One row per case: median ms per layer call of each variant, the cost of paging (the kernel over scattered
    blocks / over consecutive ones) and the kernel against SDPA; the variants' outputs are checked to agree."""
    from pagedllm import kernels

    if kernels.load() is None:
        raise ValueError(f"the C++ attention kernel did not build: {kernels.build_error()}")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for case in attention_cases(quick, gen):
        x = attention_inputs(case, gen)
        variants = attention_variants(case, x)
        with torch.inference_mode():
            out = {name: fn(0).float() for name, fn in variants.items()}
            ms = median_ms(variants, max(3, repeats * 256 // case.lens[0]) if case.kind == "prefill" else repeats)
        rows.append({
            "case": case.name, "kind": case.kind, "seqs": len(case.lens), "tokens": sum(case.lens),
            "heads": case.heads, "kv_heads": case.kv_heads, "head_dim": HEAD_DIM, "dtype": str(case.dtype)[6:],
            "layers": len(x.scattered), **{f"{name}_ms": round(v, 4) for name, v in ms.items()},
            "paging_cost": round(ms["cpp"] / ms["cpp_consecutive"], 3),
            "cpp_over_sdpa": round(ms["cpp"] / ms["sdpa"], 3),
            "same_output_consecutive": bool(torch.equal(out["cpp"], out["cpp_consecutive"])),
            "max_abs_diff": {name: float((o - out["reference"]).abs().max()) for name, o in out.items()
                             if name != "reference"}})
    return rows


def print_attention_table(rows: list[dict[str, Any]], threads: int) -> None:
    print(f"torch threads={threads}; median ms per layer call. cpp: the paged kernel, blocks in random order; "
          "consecutive: the same kernel, each sequence's blocks consecutive; SDPA: a dense, non-paged cache")
    print("| case | dtype | cpp | cpp consecutive | paging cost | reference | contiguous SDPA | cpp / SDPA |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['dtype']} | {r['cpp_ms']:.3f} | {r['cpp_consecutive_ms']:.3f} | "
              f"{r['paging_cost']:.2f}x | {r['reference_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['cpp_over_sdpa']:.2f} |")


def plot_attention(result: dict[str, Any], path: str) -> None:
    """Grouped bars (log scale): each variant's ms per call, per case."""
    from pagedllm.bench_serve import pyplot

    plt = pyplot()
    rows = result["rows"]
    variants = {"cpp": "cpp (paged)", "cpp_consecutive": "cpp (consecutive)", "sdpa": "SDPA (dense)",
                "reference": "reference"}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5))
    width = 0.8 / len(variants)
    for k, (name, label) in enumerate(variants.items()):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))], [r[f"{name}_ms"] for r in rows], width,
               label=label)
    ax.set_xticks(range(len(rows)), [f"{r['case'].replace(', ', chr(10))}\n{r['dtype']}" for r in rows],
                  fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer call (median)")
    ax.set_title(f"attention kernels, {result['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_attention(args: argparse.Namespace) -> int:
    threads = args.threads or os.cpu_count() or 1
    if args.repeats < 1:
        raise ValueError(f"--repeats must be positive, got {args.repeats}")
    load_before = os.getloadavg()
    rows = bench_attention(threads, args.repeats, args.quick, args.seed)
    print_attention_table(rows, threads)
    result = {"threads": threads, "repeats": args.repeats, "quick": args.quick, "block_size": BLOCK_SIZE,
              "machine": f"{platform.machine()} {os.cpu_count()} cpus",
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    return finish(args, result, plot_attention)


# ---- command line --------------------------------------------------------------------------------------------------
def add_command(sub: argparse._SubParsersAction, add_engine_args: Callable) -> None:
    """`pagedllm bench latency` (a decode step's time, split into parts) and `pagedllm bench attention`."""
    lt = sub.add_parser("latency", help="one batch, per-step time: prefill and decode steps per batch size and "
                                        "context length, each step split into its parts, against the machine's limit")
    lt.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8,32,64,128)")
    lt.add_argument("--context-lens", default=None, help="prompt tokens, comma-separated (default 128,512,2048)")
    lt.add_argument("--steps", type=int, default=None, help="decode steps timed (default 10)")
    lt.add_argument("--warmup-steps", type=int, default=2)
    lt.add_argument("--max-kv-gib", type=float, default=8.0, help="skip runs whose KV cache would exceed this")
    lt.add_argument("--peak-gflops", type=float, default=None,
                    help="peak matmul GFLOP/s in the model's dtype (default: this machine's, bf16 390, fp32 190)")
    lt.add_argument("--mem-gbps", type=float, default=20.0, help="memory bandwidth, GB/s")
    lt.add_argument("--measure-machine", action="store_true",
                    help="measure peak GFLOP/s (a 2048^3 matmul) and bandwidth (a large copy) instead")
    lt.add_argument("--quick", action="store_true", help=f"batch sizes {QUICK_BATCH_SIZES}, contexts "
                                                         f"{QUICK_CONTEXT_LENS}, {QUICK_STEPS} steps (a smoke test)")
    lt.add_argument("--output-json", default=None)
    lt.add_argument("--plot", default=None, help="PNG of the step's parts, stacked, per batch size and context")
    add_engine_args(lt)
    # Unless --num-blocks or --kv-cache-memory is given, each run's KV cache is sized to what it needs.
    lt.set_defaults(func=cmd_latency, kv_cache_memory=None)

    at = sub.add_parser("attention", help="the paged attention kernel against the same kernel over consecutive "
                                          "blocks, the reference and SDPA over a dense cache")
    at.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    at.add_argument("--repeats", type=int, default=15, help="timed calls per variant (prefill: scaled down)")
    at.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    at.add_argument("--seed", type=int, default=0)
    at.add_argument("--output-json", default=None)
    at.add_argument("--plot", default=None, help="PNG bar chart of the variants' times")
    at.set_defaults(func=cmd_attention)
