"""`pagedllm bench sweep`: the vLLM paper's Figure 12. For each KV memory policy it launches a server, runs every
request rate against it and plots normalized latency against request rate, one line per policy; the highest rate each
policy sustains is read off the points.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pagedllm.bench.client import run_async, run_benchmark
from pagedllm.bench.plots import plot_sweep, plot_timelines, timeline_path
from pagedllm.bench.results import write_json
from pagedllm.bench.sampling_flags import add_sampling_args, sampling_overrides
from pagedllm.bench.serve import add_workload_args, context, sample_workload
from pagedllm.bench.server_process import ServerProcess, engine_actions, fetch_model_card, passthrough_argv
from pagedllm.bench.summary import rate_json, summarize
from pagedllm.config import EngineConfig

SWEEP_SERVER_FLAGS = ["--disable-log-requests", "--uvicorn-log-level", "warning"]  # quiet server logs
SUMMARY_KEYS = ("requests_per_s", "output_tokens_per_s", "normalized_latency_s_per_token", "num_failed")


def add_command(sub: argparse._SubParsersAction) -> None:
    """`pagedllm bench sweep` (launches servers; its workload flags are `bench serve`'s)."""
    sw = sub.add_parser("sweep", help="the vLLM paper's Figure 12: for each KV policy launch a server and run "
                                      "every request rate; normalized latency vs rate")
    sw.add_argument("--request-rates", default="0.5,1,2,4", help="comma-separated requests per second")
    sw.add_argument("--kv-policies", default="paged", help="comma-separated values of the server's --kv-policy")
    add_workload_args(sw)
    add_sampling_args(sw)
    sw.add_argument("--latency-threshold", type=float, default=None,
                    help="normalized latency (s/token) a sustainable rate stays under "
                         "(default: --threshold-factor x paged's latency at the lowest rate)")
    sw.add_argument("--threshold-factor", type=float, default=5.0)
    sw.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for a server's /health")
    sw.add_argument("--port", type=int, default=None, help="port of each launched server, on 127.0.0.1, one at a "
                                                         "time (default: a free one)")
    sw.add_argument("--server-log-dir", default=None)
    sw.add_argument("--output-json", default=None)
    sw.add_argument("--plot", default=None, help="PNG of normalized latency vs request rate; the timelines go to "
                                                 "PLOT-timeline.png")
    EngineConfig.add_cli_args(sw)  # passed to every server; --seed also seeds the workload
    sw.set_defaults(func=functools.partial(cmd_sweep, actions=engine_actions()))


def run_sweep(requests: Sequence[Any], rates: Sequence[float], policies: Sequence[str], server_argv: Sequence[str],
              *, arrivals: Callable[[int, float], list[float]], pass_policy: bool = True,
              max_concurrency: int | None = None, log_dir: str | None = None, server_timeout: float = 600.0,
              sample_interval: float = 0.5, env: dict[str, str] | None = None,
              progress: bool | None = None, port: int | None = None,
              sampling: Mapping[str, float | int] | None = None) -> dict[str, Any]:
    """For each policy: launch `pagedllm serve SERVER_ARGV --kv-policy P`, run the same requests at every rate (in
    the order given, arrivals from `arrivals(num, rate)`), stop the server. Every run's summary is one point.
    `sampling`: request fields every request carries (temperature, top_p, top_k; default greedy)."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="pagedllm-sweep-")
    os.makedirs(log_dir, exist_ok=True)
    points = []
    for policy in policies:
        argv = [*server_argv, *(["--kv-policy", policy] if pass_policy else [])]
        log_path = os.path.join(log_dir, f"server-{policy}.log")
        print(f"[{policy}] launching the server (log: {log_path})", file=sys.stderr)
        with ServerProcess(argv, log_path, server_timeout, env, port) as server:
            model = fetch_model_card(server.url)["id"]
            for rate in rates:
                run = run_async(run_benchmark(server.url, model, requests, arrivals(len(requests), rate),
                                                max_concurrency=max_concurrency, sample_interval=sample_interval,
                                                progress=progress, sampling=sampling))
                point = {"kv_policy": policy, **summarize(run, rate)}
                points.append(point)
                print(f"[{policy}] rate {rate}: " + ", ".join(f"{k} {point[k]}" for k in SUMMARY_KEYS),
                      file=sys.stderr)
    return {"policies": list(policies), "request_rates": [rate_json(r) for r in rates],
            "sampling": dict(sampling or {}), "server_argv": list(server_argv), "server_port": port,
            "server_log_dir": log_dir, "points": points}


def max_sustainable_rates(points: Sequence[dict[str, Any]], policies: Sequence[str],
                          threshold: float) -> dict[str, float | str | None]:
    """Per policy, the highest rate up to which every run kept normalized latency at or below `threshold` with no
    failed request (rates taken in increasing order); None if even the lowest rate did not."""
    best: dict[str, float | str | None] = {}
    for policy in policies:
        runs = sorted((p for p in points if p["kv_policy"] == policy), key=lambda p: float(p["request_rate"]))
        best[policy] = None
        for p in runs:
            latency = p["normalized_latency_s_per_token"]
            if p["num_failed"] or latency is None or latency > threshold:
                break
            best[policy] = p["request_rate"]
    return best


def default_threshold(points: Sequence[dict[str, Any]], policies: Sequence[str], factor: float) -> float | None:
    """`factor` x the normalized latency at the lowest rate of `paged` (of the first policy if paged is absent)."""
    reference = "paged" if "paged" in policies else policies[0]
    runs = [p for p in points if p["kv_policy"] == reference and p["normalized_latency_s_per_token"]]
    if not runs:
        return None
    return factor * min(runs, key=lambda p: float(p["request_rate"]))["normalized_latency_s_per_token"]


def cmd_sweep(args: argparse.Namespace, actions: Sequence[argparse.Action]) -> int:
    from pagedllm.bench.datasets import poisson_arrivals
    from pagedllm.model.loader import load_tokenizer

    rates = [float(r) for r in args.request_rates.split(",") if r.strip()]
    policies = [p.strip() for p in args.kv_policies.split(",") if p.strip()]
    if not rates or not all(r > 0 for r in rates):
        raise ValueError(f"--request-rates must be positive numbers, got {args.request_rates!r}")
    if not policies:
        raise ValueError("--kv-policies names no policy")
    pass_policy = any(a.dest == "kv_policy" for a in actions)
    if not pass_policy and policies != ["paged"]:
        raise ValueError("this pagedllm has no --kv-policy flag: only the paged policy can be swept")
    requests = sample_workload(args, load_tokenizer(args.model), args.max_model_len, args.seed)
    try:
        result = run_sweep(requests, rates, policies, passthrough_argv(args, actions) + SWEEP_SERVER_FLAGS,
                           arrivals=functools.partial(poisson_arrivals, seed=args.seed), pass_policy=pass_policy,
                           max_concurrency=args.max_concurrency, log_dir=args.server_log_dir,
                           server_timeout=args.server_timeout, sample_interval=args.metrics_interval,
                           port=args.port, sampling=sampling_overrides(args))
    except RuntimeError as e:  # a server that would not start: its log says why
        print(f"error: {e}", file=sys.stderr)
        return 1
    threshold = args.latency_threshold or default_threshold(result["points"], policies, args.threshold_factor)
    result = {"model": args.model, **context(args), **result, "latency_threshold_s_per_token": threshold,
              "max_sustainable_rate": max_sustainable_rates(result["points"], policies, threshold or math.inf)}
    print_sweep(result)
    if args.output_json:
        write_json(args.output_json, result)
    if args.plot:
        plot_sweep(result, args.plot)
        plot_timelines([(f"rate {rate} req/s", {p["kv_policy"]: p["timeline"] for p in result["points"]
                                                if p["request_rate"] == rate}) for rate in result["request_rates"]],
                       timeline_path(args.plot))
    return 0


def print_sweep(result: dict[str, Any]) -> None:
    print(f"{'policy':<18}{'rate':>8}{'norm. latency s/tok':>21}{'req/s':>9}{'failed':>8}{'peak running':>14}")
    for p in result["points"]:
        latency = p["normalized_latency_s_per_token"]
        print(f"{p['kv_policy']:<18}{p['request_rate']!s:>8}{'-' if latency is None else f'{latency:.4f}':>21}"
              f"{p['requests_per_s'] or 0:>9.2f}{p['num_failed']:>8}{p['peak_num_running'] or '-'!s:>14}")
    threshold = result["latency_threshold_s_per_token"]
    print(f"max sustainable rate (normalized latency <= {threshold if threshold is None else round(threshold, 4)} "
          "s/token, no failures):")
    for policy, rate in result["max_sustainable_rate"].items():
        print(f"  {policy:<18}{'none of the rates' if rate is None else f'{rate} req/s'}")
