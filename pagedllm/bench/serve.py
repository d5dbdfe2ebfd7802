"""Online serving benchmarks against an OpenAI-compatible server: the vLLM paper's section 6.2 and Figure 12.

`pagedllm bench serve`: requests arrive as a Poisson process and stream /v1/completions; per request the client
times the first token, the gaps between tokens and the whole request, and reports the paper's normalized latency
(the mean over requests of end-to-end latency / output tokens) beside the server's own /metrics figures.
`pagedllm bench sweep`: Figure 12's curves. For each KV memory policy it launches a server, runs every request rate
against it and plots normalized latency against request rate, one line per policy.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import httpx
import numpy as np

from pagedllm.bench.results import write_json
from pagedllm.config import EngineConfig

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
RUNNING_MAX = "pagedllm:num_requests_running_max"
PREEMPTIONS = "pagedllm:num_preemptions_total"
# /metrics gauges sampled during a run, under the names the timeline uses. kv_waste_fraction is read only if the
# server exports it (the share of reserved KV slots that hold no token).
SAMPLED = {"num_running": "pagedllm:num_requests_running", "num_waiting": "pagedllm:num_requests_waiting",
           "kv_cache_usage": "pagedllm:kv_cache_usage_perc", "kv_waste_fraction": "pagedllm:kv_waste_fraction"}
SAMPLED_NAMES = frozenset(SAMPLED.values())
T = TypeVar("T")
SWEEP_SERVER_FLAGS = ["--disable-log-requests", "--uvicorn-log-level", "warning"]  # quiet server logs
SUMMARY_KEYS = ("requests_per_s", "output_tokens_per_s", "normalized_latency_s_per_token", "num_failed")


# ---- one request -------------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds, `start_s` from the run's start."""

    prompt_len: int
    n: int = 1
    start_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    prompt_tokens: int | None = None  # as the server's usage counts them (a chat's rendered template included)
    text: str = ""  # the first choice's text (a chat's reply, for the next turn's history)


def completion_payload(model: str, request: Any) -> dict[str, Any]:
    """A streamed /v1/completions body for a BenchRequest: token ids as the prompt (exact lengths), exactly
    output_len tokens per sample (ignore_eos), greedy unless several samples are wanted."""
    return {"model": model, "prompt": list(request.prompt_token_ids), "max_tokens": request.output_len,
            "n": request.n, "temperature": 1.0 if request.n > 1 else 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def error_message(body: bytes | dict) -> str:
    """The message of an OpenAI-style error body, else the body itself (cut short)."""
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            return body[:300].decode(errors="replace")
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]


async def send_request(client: aiohttp.ClientSession, payload: dict[str, Any], result: RequestResult,
                       t0: float, path: str = "v1/completions") -> None:
    """Stream one completion (or chat completion, by `path`), timing every chunk per choice; a failure is recorded
    in `result`, never raised."""
    start = time.perf_counter()
    result.start_s = start - t0
    last_chunk: dict[int, float] = {}  # choice index -> arrival of its latest chunk
    done = False
    try:
        async with client.post(path, json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {error_message(await response.read())}"
                return
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = error_message(event)
                    return
                record_chunk(event, time.perf_counter(), start, last_chunk, result)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return
    result.latency_s = time.perf_counter() - start
    if not done:
        result.error = "the stream ended before [DONE]"
    elif not result.output_tokens:  # a server that ignores include_usage: one token per chunk
        result.output_tokens = len(result.itl_s) + len(last_chunk)


def record_chunk(event: dict[str, Any], now: float, start: float, last_chunk: dict[int, float],
                 result: RequestResult) -> None:
    """TTFT at the first chunk of any choice; an inter-token gap at every later chunk of the same choice. A chat
    chunk without content (the role sent before any token, the finish) carries no token."""
    for choice in event.get("choices") or []:
        index = choice.get("index", 0)
        delta = choice.get("delta")
        if delta is not None and not (delta.get("content") or delta.get("tool_calls")):
            continue
        if index == 0:
            result.text += choice.get("text") or (delta or {}).get("content") or ""
        if index in last_chunk:
            result.itl_s.append(now - last_chunk[index])
        elif result.ttft_s is None:
            result.ttft_s = now - start
        last_chunk[index] = now
    if usage := event.get("usage"):
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_tokens = usage.get("prompt_tokens")


# ---- server metrics ----------------------------------------------------------------------------------------------
async def scrape_metrics(client: aiohttp.ClientSession, names: Collection[str] | None = None,
                         ) -> dict[str, float] | None:
    """Every sample of the server's /metrics (Prometheus text) by name, summed over labels, or only those of `names`
    (read straight off their lines: the full parser cost the client 4 ms a scrape, twice a second, on the server's
    cores); None if it has none."""
    try:
        async with client.get("metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status != 200:
                return None
            text = await response.text()
        return parse_metrics(text) if names is None else gauge_values(text, names)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def parse_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def gauge_values(text: str, names: Collection[str]) -> dict[str, float]:
    """The samples of `names` in Prometheus text, summed over labels (a line is `name{labels} value [timestamp]`)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = line.find("{")
        name = line[:end] if end != -1 else line.split(" ", 1)[0]
        if name in names:
            value = line[line.rindex("}") + 1:] if end != -1 else line[len(name):]
            values[name] = values.get(name, 0.0) + float(value.split()[0])
    return values


class MetricsSampler:
    """The server's batch size and KV cache gauges every `interval` seconds while a run lasts (its timeline)."""

    def __init__(self, client: aiohttp.ClientSession, interval: float) -> None:
        self.client, self.interval = client, interval
        self.samples: list[dict[str, float | None]] = []
        self.task: asyncio.Task | None = None

    def start(self, t0: float) -> None:
        if self.interval > 0:
            self.task = asyncio.create_task(self._loop(t0))

    async def stop(self) -> list[dict[str, float | None]]:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        return self.samples

    async def _loop(self, t0: float) -> None:
        while (values := await scrape_metrics(self.client, SAMPLED_NAMES)) is not None:
            sample: dict[str, float | None] = {"t_s": round(time.perf_counter() - t0, 3)}
            sample |= {key: values.get(name) for key, name in SAMPLED.items()}
            self.samples.append(sample)
            await asyncio.sleep(self.interval)


# ---- one run -----------------------------------------------------------------------------------------------------
@dataclass
class BenchmarkRun:
    """Everything one run measured, before it is summarized."""

    results: list[RequestResult]
    duration_s: float
    timeline: list[dict[str, float | None]]
    metrics_before: dict[str, float] | None
    metrics_after: dict[str, float] | None
    loadavg: tuple[list[float], list[float]] = ([], [])


def http_client(base_url: str, api_key: str | None) -> aiohttp.ClientSession:
    """No connection limit (concurrency is the benchmark's to set) and no read timeout (requests may queue long).
    aiohttp, as vLLM's benchmark client uses: its C HTTP parser keeps the client's share of a shared CPU small."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base_url = base_url.rstrip("/") + "/"  # relative paths then join under a path prefix (a proxy's)
    return aiohttp.ClientSession(base_url=base_url, headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, connect=30.0), read_bufsize=1 << 20)


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed (a server's extra does): the client shares the server's cores, and
    uvloop's C loop costs it less per streamed chunk than asyncio's selector loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def run_benchmark(base_url: str, model: str, requests: Sequence[Any], arrivals: Sequence[float], *,
                        max_concurrency: int | None = None, api_key: str | None = None,
                        sample_interval: float = 0.5, progress: bool | None = None,
                        models: Sequence[str] | None = None) -> BenchmarkRun:
    """Send request i at `arrivals[i]` seconds after the start (at most `max_concurrency` in flight), wait for all,
    sampling /metrics meanwhile. `models`: request i's model name (LoRA adapters), else `model` for all. progress
    None: a progress bar only on a terminal."""
    from tqdm import tqdm

    if len(arrivals) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    models = list(models) if models is not None else [model] * len(requests)
    if len(models) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(models)} model names")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be positive, got {max_concurrency}")
    results = [RequestResult(len(r.prompt_token_ids), r.n) for r in requests]
    load_before = os.getloadavg()
    async with http_client(base_url, api_key) as client:
        before = await scrape_metrics(client)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        sampler = MetricsSampler(client, sample_interval)
        with tqdm(total=len(requests), disable=None if progress is None else not progress, unit="req") as bar:
            t0 = time.perf_counter()
            sampler.start(t0)

            async def arrive(request: Any, at: float, result: RequestResult, name: str) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                async with gate:
                    await send_request(client, completion_payload(name, request), result, t0)
                bar.update()

            await asyncio.gather(*(arrive(*args) for args in zip(requests, arrivals, results, models)))
            duration = time.perf_counter() - t0
        timeline = await sampler.stop()
        after = await scrape_metrics(client)
    return BenchmarkRun(results, duration, timeline, before, after,
                        ([round(x, 2) for x in load_before], [round(x, 2) for x in os.getloadavg()]))


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


# ---- plots (matplotlib only when asked for) ----------------------------------------------------------------------
def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timelines(panels: Sequence[tuple[str, dict[str, list[dict]]]], path: str) -> None:
    """KV cache usage (top) and running requests (bottom) over time: one column per (title, {label: timeline})."""
    plt = pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 6), sharex="col", squeeze=False)
    for col, (title, timelines) in enumerate(panels):
        for label, timeline in timelines.items():
            t = [s["t_s"] for s in timeline]
            axes[0][col].plot(t, [100 * (s["kv_cache_usage"] or 0) for s in timeline], label=label or None)
            axes[1][col].plot(t, [s["num_running"] or 0 for s in timeline], label=label or None)
        axes[0][col].set_title(title)
        axes[1][col].set_xlabel("time (s)")
    axes[0][0].set_ylabel("KV cache usage (%)")
    axes[1][0].set_ylabel("running requests")
    if any(label for _, timelines in panels for label in timelines):
        axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(result: dict[str, Any], path: str) -> None:
    """Figure 12's shape: normalized latency against request rate, one line per memory policy."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for policy in result["policies"]:
        points = [p for p in result["points"] if p["kv_policy"] == policy and p["normalized_latency_s_per_token"]
                  and math.isfinite(float(p["request_rate"]))]  # an all-at-once run has no place on a rate axis
        ax.plot([float(p["request_rate"]) for p in points], [p["normalized_latency_s_per_token"] for p in points],
                marker="o", label=policy)
    if result.get("latency_threshold_s_per_token"):
        ax.axhline(result["latency_threshold_s_per_token"], color="grey", linestyle="--", linewidth=1,
                   label="threshold")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{os.path.basename(os.path.normpath(result.get('model') or 'default model'))}, "
                 f"{result.get('dataset')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timeline_path(path: str) -> str:
    stem, ext = os.path.splitext(path)
    return f"{stem}-timeline{ext or '.png'}"


# ---- the sweep: one launched server per memory policy --------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagedllm serve ARGV` as a subprocess on `port` (default: a free local one), ready (/health) for as long as the
    `with` lasts."""

    def __init__(self, argv: Sequence[str], log_path: str, timeout: float = 600.0,
                 env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.argv, self.log_path, self.timeout, self.env = list(argv), log_path, timeout, env
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(self.port), *self.argv]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        raise RuntimeError(f"the server was not ready after {self.timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]


def fetch_model_card(base_url: str, api_key: str | None = None) -> dict[str, Any]:
    """The first model the server lists (its id, and max_model_len / root where the server says them)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {base_url}: {e}") from None
    if response.status_code != 200:
        raise ValueError(f"{base_url}/v1/models: HTTP {response.status_code}: {error_message(response.content)}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]


def run_sweep(requests: Sequence[Any], rates: Sequence[float], policies: Sequence[str], server_argv: Sequence[str],
              *, arrivals: Callable[[int, float], list[float]], pass_policy: bool = True,
              max_concurrency: int | None = None, log_dir: str | None = None, server_timeout: float = 600.0,
              sample_interval: float = 0.5, env: dict[str, str] | None = None,
              progress: bool | None = None, port: int | None = None) -> dict[str, Any]:
    """For each policy: launch `pagedllm serve SERVER_ARGV --kv-policy P`, run the same requests at every rate (in
    the order given, arrivals from `arrivals(num, rate)`), stop the server. Every run's summary is one point."""
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
                                                progress=progress))
                point = {"kv_policy": policy, **summarize(run, rate)}
                points.append(point)
                print(f"[{policy}] rate {rate}: " + ", ".join(f"{k} {point[k]}" for k in SUMMARY_KEYS),
                      file=sys.stderr)
    return {"policies": list(policies), "request_rates": [rate_json(r) for r in rates],
            "server_argv": list(server_argv), "server_port": port, "server_log_dir": log_dir, "points": points}


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


# ---- command line ------------------------------------------------------------------------------------------------
def add_command(sub: argparse._SubParsersAction) -> None:
    """`pagedllm bench serve` (a client for a running server) and `pagedllm bench sweep` (launches servers)."""
    sv = sub.add_parser("serve", help="online serving benchmark against a running OpenAI-compatible server")
    sv.add_argument("--base-url", default=DEFAULT_BASE_URL)
    sv.add_argument("--model", default=None, help="model name sent to the API, also the tokenizer's source if it "
                                                  "is a path (default: the server's first model)")
    sv.add_argument("--tokenizer", default=None, help="model folder or .gguf whose tokenizer makes the prompts "
                                                      "(default: --model, the server's model path, or the default)")
    sv.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"))
    sv.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival times")
    sv.add_argument("--request-rate", type=float, default=math.inf,
                    help="mean requests per second of the Poisson arrivals (inf: all at once)")
    sv.add_argument("--models", default=None, help="comma-separated model names (LoRA adapters, the base model's "
                                                   "name) the requests are spread over (default: --model for all)")
    sv.add_argument("--model-zipf", type=float, default=1.0,
                    help="with --models: name k is picked with weight 1 / (k + 1) ** EXPONENT (0: uniform)")
    add_workload_args(sv)
    sv.add_argument("--output-json", default=None)
    sv.add_argument("--plot", default=None, help="PNG of KV cache usage and running requests over time")
    sv.set_defaults(func=cmd_serve)

    sw = sub.add_parser("sweep", help="the vLLM paper's Figure 12: for each KV policy launch a server and run "
                                      "every request rate; normalized latency vs rate")
    sw.add_argument("--request-rates", default="0.5,1,2,4", help="comma-separated requests per second")
    sw.add_argument("--kv-policies", default="paged", help="comma-separated values of the server's --kv-policy")
    add_workload_args(sw)
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


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random", help="a name of pagedllm.bench.datasets.DATASETS")
    g.add_argument("--dataset-path", default=None)
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--input-len", type=int, default=None)
    g.add_argument("--output-len", type=int, default=None)
    g.add_argument("--n", type=int, default=4, help="samples per request (parallel-sampling)")
    g.add_argument("--beam-width", type=int, default=4, help="beam-search: not served over the OpenAI API")
    g.add_argument("--prefix-len", type=int, default=200, help="shared-prefix: tokens of the shared prefix")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: any)")
    g.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples (0: none)")


def engine_actions() -> list[argparse.Action]:
    """The engine flags' argparse actions, from a throwaway parser (argparse has no public list of them)."""
    probe = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_cli_args(probe)
    return list(probe._actions)


def passthrough_argv(args: argparse.Namespace, actions: Sequence[argparse.Action]) -> list[str]:
    """The engine flags set on this command line (not at their defaults) as argv for `pagedllm serve`;
    --kv-policy is left out, the sweep sets it per launch."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest == "kv_policy" or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0] if value else action.option_strings[1])
        elif action.nargs == 0:
            argv.append(action.option_strings[0])
        elif isinstance(value, list):
            argv += [action.option_strings[0], *map(str, value)]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def servable(requests: list[Any]) -> list[Any]:
    """The requests an OpenAI-compatible server can take: /v1/completions has no beam search, so those are
    skipped, with a message."""
    beams = [r for r in requests if r.beam_width > 0]
    if beams:
        print(f"skipping {len(beams)} beam-search requests: /v1/completions offers no beam search "
              "(run `pagedllm bench sharing` for beam search)", file=sys.stderr)
    kept = [r for r in requests if r.beam_width <= 0]
    if not kept:
        raise ValueError("no request left to send: every request of this workload needs beam search")
    return kept


def sample_workload(args: argparse.Namespace, tokenizer: Any, max_model_len: int | None, seed: int) -> list[Any]:
    from pagedllm.bench.datasets import sample_requests

    return servable(sample_requests(args.dataset, tokenizer, args.num_prompts, seed, dataset_path=args.dataset_path,
                                    input_len=args.input_len, output_len=args.output_len,
                                    max_model_len=max_model_len, n=args.n, beam_width=args.beam_width,
                                    prefix_len=args.prefix_len))


def tokenizer_source(explicit: str | None, model: str, card: dict[str, Any]) -> str | None:
    """Where the client's tokenizer comes from: --tokenizer, else the model name or the server's model path if
    either is a local path, else None (the default model)."""
    candidates = [explicit, model, card.get("root")]
    return next((c for c in candidates if c and os.path.exists(os.path.expanduser(c))), explicit)


def context(args: argparse.Namespace) -> dict[str, Any]:
    return {"dataset": args.dataset, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus"}


def request_models(names: str | None, count: int, exponent: float, seed: int) -> list[str] | None:
    """Each request's model name drawn from the comma-separated `names` by a Zipf law (the first the most often),
    seeded; None without names."""
    from pagedllm.bench.lora import zipf_picks

    if names is None:
        return None
    choices = [n.strip() for n in names.split(",") if n.strip()]
    if not choices:
        raise ValueError("--models names no model")
    return [choices[k] for k in zipf_picks(len(choices), count, exponent, random.Random(seed))]


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.bench.datasets import poisson_arrivals
    from pagedllm.model.loader import load_tokenizer

    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {args.request_rate}")
    card = fetch_model_card(args.base_url, args.api_key)
    model = args.model or card["id"]
    source = tokenizer_source(args.tokenizer, model, card)
    print(f"model {model}; tokenizer of {source or 'the default model'}", file=sys.stderr)
    requests = sample_workload(args, load_tokenizer(source), card.get("max_model_len"), args.seed)
    models = request_models(args.models, len(requests), args.model_zipf, args.seed)
    run = run_async(run_benchmark(args.base_url, model, requests,
                                    poisson_arrivals(len(requests), args.request_rate, args.seed),
                                    max_concurrency=args.max_concurrency, api_key=args.api_key,
                                    sample_interval=args.metrics_interval, models=models))
    summary = {"model": model, "base_url": args.base_url, **context(args), **summarize(run, args.request_rate)}
    if models is not None:
        summary["requests_per_model"] = dict(collections.Counter(models))
    print_summary(summary)
    if args.output_json:
        write_json(args.output_json, summary)
    if args.plot:
        plot_timelines([(f"{args.dataset}, rate {rate_json(args.request_rate)} req/s", {"": run.timeline})],
                       args.plot)
    return 0


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
                           port=args.port)
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
