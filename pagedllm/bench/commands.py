"""The `pagedllm bench ...` command table: each benchmark module adds its own subcommands."""

from __future__ import annotations

import argparse

from pagedllm.bench import (
    accuracy,
    attention,
    fairness,
    kernels,
    latency,
    lora,
    route,
    serve,
    sessions,
    sharing,
    soak,
    structured,
    sweep,
    throughput,
)


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    for module in (throughput, sharing, serve, sweep, latency, attention, accuracy, soak, route, structured, fairness,
                   sessions, kernels, lora):
        module.add_command(sub)
