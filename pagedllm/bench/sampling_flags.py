"""The benchmarks' sampling flags (`bench throughput`, `bench serve`, `bench sweep`): every request sampled as they
say, else each command's default (greedy, or temperature 1 for parallel samples)."""

from __future__ import annotations

import argparse


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=None, help="sample every request at this temperature "
                   "(default: greedy, or 1.0 for parallel samples)")
    g.add_argument("--top-p", type=float, default=None, help="sample every request with this top-p")
    g.add_argument("--top-k", type=int, default=None, help="sample every request with this top-k")


def sampling_overrides(args: argparse.Namespace) -> dict[str, float | int]:
    """--temperature, --top-p, --top-k as SamplingParams / request fields; top-p or top-k alone sample at
    temperature 1."""
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    overrides = {k: v for k, v in flags.items() if v is not None}
    if overrides and "temperature" not in overrides:
        overrides["temperature"] = 1.0
    return overrides
