"""`pagedllm bench kernels`: the measured kernel choice (model/dispatch.py) made afresh on this machine and printed,
each matmul kind's paths x row counts with their times and the winner, and the table it caches for the engine, with
the step budget it gives (model/step_budget.py). Beside it, oneDNN's fp32 and bf16 matmuls on the model's biggest
layer shape: what `--dtype auto` rests on."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time

import torch

from pagedllm.config import EngineConfig
from pagedllm.model import attention_dispatch, dispatch, kernel_timing, machine_cache, step_budget
from pagedllm.model.bf16_choice import torch_dtype_name
from pagedllm.model.layers import PackedWeight
from pagedllm.model.model_runner import ModelRunner, attention_shape, kernel_variant

DTYPE_ROWS = (1, 64, 256)


def build_untuned(config: EngineConfig) -> tuple[ModelRunner, str]:
    """The engine's own model, with every form its flags allow still there (the engine drops the ones it routes
    nowhere): built with the dispatch held at the static routes (matmuls and attention, measured afresh after)."""
    held = {dispatch.FORCE_ENV: "static", attention_dispatch.FORCE_ENV: "static"}
    previous = {name: os.environ.get(name) for name in held}
    os.environ.update(held)
    try:
        runner, _, name = ModelRunner.from_config(config)
    finally:
        for var, value in previous.items():
            os.environ.pop(var) if value is None else os.environ.update({var: value})
    return runner, name


def dtype_times(shape: tuple[int, int]) -> dict[str, list[float]]:
    """Seconds per oneDNN matmul of `shape` in fp32 and in bf16 at DTYPE_ROWS rows (the fastest of 8)."""
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(shape, generator=g) * 0.05
    out: dict[str, list[float]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        if not PackedWeight.available(dtype):
            continue
        weight = PackedWeight(plain.to(dtype))
        times = []
        for rows in DTYPE_ROWS:
            run = functools.partial(weight.mm, torch.randn(rows, shape[1], generator=g).to(dtype), path="onednn")
            times.append(min(kernel_timing.time_call("dtype", "onednn", rows, run) for _ in range(8)))
        out[str(dtype).removeprefix("torch.")] = times
    return out


def print_table(table: dispatch.KernelTable) -> None:
    for kind, paths in table.times.items():
        won = table.winners(kind)
        if len(paths) == 1:
            print(f"\n{kind}: {next(iter(paths))} only (nothing to compare)")
            continue
        print(f"\n{kind} ({', '.join(paths)})")
        print(f"{'rows':>6} " + " ".join(f"{p:>10}" for p in paths) + f" {'winner':>10}")
        for i, rows in enumerate(table.buckets[kind]):
            cells = " ".join(f"{'-' if t[i] is None else f'{t[i] * 1e6:.0f} us':>10}" for t in paths.values())
            print(f"{rows:>6} {cells} {won[i]:>10}")
    print(f"\nroutes: {table.summary()}")
    print(dispatch.bounded_shapes(table)[1])  # the decision, its inputs, and whether this process pads


def print_attention(table: attention_dispatch.AttentionTable) -> None:
    """The attention route's measurements: the row and tiled kernels per query-row count in each kind of step."""
    kept = "cached" if machine_cache.quiet(table.load, table.others_cpu) else "not cached: the machine was busy"
    print(f"\nattention, measured in {table.seconds:.2f} s ({kept}); times per call, the fastest of "
          f"{attention_dispatch.SAMPLES}")
    for regime, rows in table.rows.items():
        print(f"{regime} steps: {attention_dispatch.REGIME_TEXT[regime]}")
        print(f"{'rows':>6} {'row kernel':>11} {'tiled':>10} {'winner':>10}")
        for i, r in enumerate(rows):
            t_rows, t_tile = (table.times[regime][k][i] for k in ("rows", "tile"))
            won = "tiled" if t_tile <= t_rows else "rows"
            print(f"{r:>6} {t_rows * 1e6:>8.0f} us {t_tile * 1e6:>7.0f} us {won:>10}")
    if table.chunks:
        print(f"bf16 prompts: a step of {attention_dispatch.CHUNK_STEP} prompt tokens in prompts of this many (flash "
              f"attention wins by more than {attention_dispatch.CHUNK_MARGIN:.0%})")
        print(f"{'tokens':>7} {'tiled':>10} {'flash attention':>16} {'winner':>10}")
        for queries, t_tile, t_sdpa in zip(table.chunk_queries(), table.chunks["tile"], table.chunks["sdpa"]):
            won = "flash" if attention_dispatch.flash_wins(t_tile, t_sdpa) else "tiled"
            print(f"{queries:>7} {t_tile * 1e6:>7.0f} us {t_sdpa * 1e6:>13.0f} us {won:>10}")
    print(f"route: {table.summary()}")


def cmd_kernels(args: argparse.Namespace) -> int:
    config = EngineConfig.from_cli_args(args)
    torch.set_num_threads(config.num_threads)
    runner, name = build_untuned(config)
    weights, dtype = runner.model.packed_weights(), runner.model.dtype
    start = time.perf_counter()
    table = dispatch.tune(weights, dtype, name, refresh=True, variant=kernel_variant(config))
    if table is None:
        print(f"{dispatch.FORCE_ENV} is set: nothing measured")
        return 1
    kept = (f"cached at {machine_cache.cache_file(table.key)}" if dispatch.cacheable(table)
            else "not cached: the machine was busy")
    print(f"{name}, {dtype}, {torch.get_num_threads()} threads, {machine_cache.cpu_identity()[0]}, load "
          f"{table.load:.2f}: measured in {time.perf_counter() - start:.1f} s ({kept}); times per call, the fastest "
          f"of {kernel_timing.SAMPLES}")
    print_table(table)
    budget = step_budget.choose(table, runner.model_config.num_hidden_layers)
    print(f"step budget where --max-num-batched-tokens is not given: {budget.tokens} tokens ({budget.reason})")
    biggest = max((ws[0].shape for kind, ws in weights.items() if kind != "lm_head"), key=lambda s: s[0] * s[1])
    dtypes = dtype_times(biggest)
    print(f"\noneDNN matmul {biggest[0]}x{biggest[1]}, fp32 vs bf16 (`--dtype auto` picks {torch_dtype_name(config)})")
    for i, rows in enumerate(DTYPE_ROWS):
        print(f"{rows:>6} " + " ".join(f"{d}={t[i] * 1e6:.0f} us" for d, t in dtypes.items()))
    _, attention = attention_dispatch.tune(attention_shape(config, runner.model_config, dtype, runner.kv_dtype),
                                           refresh=True)
    if attention is not None:
        print_attention(attention)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"table": table.__dict__, "attention": attention and attention.__dict__,
                       "step_budget": budget.tokens,
                       "dtype_rows": DTYPE_ROWS, "dtype_times": dtypes,
                       "machine": f"{platform.machine()} {os.cpu_count()} cpus"}, f, indent=1)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    kc = sub.add_parser("kernels", help="time each matmul path on the model's shapes at a few row counts here, "
                                        "print the winners and cache them for the engine")
    kc.add_argument("--output-json", default=None)
    EngineConfig.add_cli_args(kc)
    kc.set_defaults(func=cmd_kernels, kv_cache_memory="64MiB")
