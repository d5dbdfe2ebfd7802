"""A serving run's figures: throughput, the vLLM paper's normalized latency, TTFT / ITL / end-to-end distributions
and what the server's /metrics said, as the JSON result and as a table laid out like vLLM's benchmark_serving.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from pagedllm.bench.client import PREEMPTIONS, RUNNING_MAX, BenchmarkRun


def distribution(name: str, values: list[float]) -> dict[str, float | None]:
    """mean / median / p99 of `values` (None when empty), as `{stat}_{name}_s`."""
    stats = {"mean": np.mean, "median": np.median, "p99": lambda v: np.percentile(v, 99)}
    return {f"{stat}_{name}_s": (round(float(fn(values)), 6) if values else None) for stat, fn in stats.items()}


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def summarize(run: BenchmarkRun, request_rate: float) -> dict[str, Any]:
    """The run's figures: throughput, normalized latency (mean over completed requests of latency / output tokens,
    all samples of a request counted), TTFT / ITL / end-to-end distributions, and the server's figures."""
    ok = [r for r in run.results if r.error is None]
    output_tokens = sum(r.output_tokens for r in ok)
    normalized = [r.latency_s / r.output_tokens for r in ok if r.output_tokens]
    duration = run.duration_s
    summary: dict[str, Any] = {
        "request_rate": rate_json(request_rate), "num_requests": len(run.results), "num_completed": len(ok),
        "num_failed": len(run.results) - len(ok), "duration_s": round(duration, 4),
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": output_tokens,
        "requests_per_s": round(len(ok) / duration, 4) if duration else None,
        "output_tokens_per_s": round(output_tokens / duration, 3) if duration else None,
        "normalized_latency_s_per_token": round(float(np.mean(normalized)), 6) if normalized else None,
        **distribution("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
        **distribution("itl", [gap for r in ok for gap in r.itl_s]),
        **distribution("e2e", [r.latency_s for r in ok]),
        **server_figures(run),
        "errors": sorted({r.error for r in run.results if r.error})[:10],
        "loadavg_before": run.loadavg[0], "loadavg_after": run.loadavg[1],
        "requests": [{"prompt_len": r.prompt_len, "n": r.n, "output_tokens": r.output_tokens,
                      "start_s": round(r.start_s, 4), "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 5),
                      "latency_s": round(r.latency_s, 5), "error": r.error} for r in run.results],
        "timeline": run.timeline,
    }
    return summary


def server_figures(run: BenchmarkRun) -> dict[str, Any]:
    """What the server's /metrics says of this run; null where it exports nothing.

    peak_num_running: the server's running-max gauge if it rose during the run (exact, it sees every step), else
    the highest sampled batch size. kv_waste_fraction: mean of the samples taken while requests were running."""
    before, after = run.metrics_before or {}, run.metrics_after or {}
    busy = [s for s in run.timeline if s["num_running"]]

    def sampled(key: str) -> list[float]:
        return [s[key] for s in run.timeline if s[key] is not None]

    peak = max(sampled("num_running"), default=None)
    if after.get(RUNNING_MAX, 0) > before.get(RUNNING_MAX, math.inf):
        peak = after[RUNNING_MAX]
    waste = [s["kv_waste_fraction"] for s in busy if s["kv_waste_fraction"] is not None]
    usage = sampled("kv_cache_usage")
    running = sampled("num_running")
    return {
        "peak_num_running": None if peak is None else int(peak),
        "mean_num_running": round(float(np.mean(running)), 3) if running else None,
        "peak_kv_cache_usage": round(max(usage), 4) if usage else None,
        "mean_kv_cache_usage": round(float(np.mean(usage)), 4) if usage else None,
        "kv_waste_fraction": round(float(np.mean(waste)), 4) if waste else None,
        "num_preemptions": int(after[PREEMPTIONS] - before[PREEMPTIONS])
        if PREEMPTIONS in after and PREEMPTIONS in before else None,
    }


def print_summary(s: dict[str, Any]) -> None:
    """A result table laid out like vLLM's benchmark_serving."""

    def row(label: str, value: Any, fmt: str = "") -> None:
        shown = "-" if value is None else format(value, fmt) if fmt and not isinstance(value, str) else value
        print(f"{label:<40}{shown:<10}")

    def ms(key: str) -> float | None:
        return None if s[key] is None else s[key] * 1000

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", s["num_completed"])
    row("Failed requests:", s["num_failed"])
    row("Request rate (req/s):", s["request_rate"])
    row("Benchmark duration (s):", s["duration_s"], ".2f")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["requests_per_s"], ".2f")
    row("Output token throughput (tok/s):", s["output_tokens_per_s"], ".2f")
    row("Normalized latency (s/token):", s["normalized_latency_s_per_token"], ".4f")
    row("Peak running requests (server):", s["peak_num_running"])
    row("Mean KV cache usage (server):", s["mean_kv_cache_usage"], ".3f")
    row("KV waste fraction (server):", s["kv_waste_fraction"], ".3f")
    row("Preemptions (server):", s["num_preemptions"])
    for name, title in (("ttft", "Time to First Token"), ("itl", "Inter-token Latency"),
                        ("e2e", "End-to-end Latency")):
        print("{s:{c}^50}".format(s=title, c="-"))
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms):", ms(f"{stat}_{name}_s"), ".2f")
    print("=" * 50)
    for error in s["errors"]:
        print(f"error: {error}", file=sys.stderr)
