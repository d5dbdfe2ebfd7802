"""The load generator's HTTP client: streamed requests timed chunk by chunk, the server's /metrics scraped and
sampled while a run lasts, and one run of requests at given arrival times. Every serving benchmark sends its requests
through here, so they all time a request the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

RUNNING_MAX = "pagedllm:num_requests_running_max"
PREEMPTIONS = "pagedllm:num_preemptions_total"
# /metrics gauges sampled during a run, under the names the timeline uses. kv_waste_fraction is read only if the
# server exports it (the share of reserved KV slots that hold no token).
SAMPLED = {"num_running": "pagedllm:num_requests_running", "num_waiting": "pagedllm:num_requests_waiting",
           "kv_cache_usage": "pagedllm:kv_cache_usage_perc", "kv_waste_fraction": "pagedllm:kv_waste_fraction"}
SAMPLED_NAMES = frozenset(SAMPLED.values())
T = TypeVar("T")


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


def completion_payload(model: str, request: Any, sampling: Mapping[str, float | int] | None = None) -> dict[str, Any]:
    """A streamed /v1/completions body for a BenchRequest: token ids as the prompt (exact lengths), exactly
    output_len tokens per sample (ignore_eos), greedy unless several samples are wanted or `sampling` (request
    fields: temperature, top_p, top_k) says otherwise."""
    return {"model": model, "prompt": list(request.prompt_token_ids), "max_tokens": request.output_len,
            "n": request.n, "temperature": 1.0 if request.n > 1 else 0.0, **(sampling or {}), "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


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
    aiohttp, as vLLM's benchmark client uses: its C HTTP parser keeps the client's share of a shared CPU small.
    One connection per request, as vLLM's client opens a session per request: a request sent on a kept-alive
    connection the server is closing fails ("Server disconnected": 6-12 of 200 against llama.cpp's llama-server)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base_url = base_url.rstrip("/") + "/"  # relative paths then join under a path prefix (a proxy's)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(base_url=base_url, headers=headers, connector=connector,
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
                        models: Sequence[str] | None = None,
                        sampling: Mapping[str, float | int] | None = None) -> BenchmarkRun:
    """Send request i at `arrivals[i]` seconds after the start (at most `max_concurrency` in flight), wait for all,
    sampling /metrics meanwhile. `models`: request i's model name (LoRA adapters), else `model` for all. `sampling`:
    fields every request's body carries (completion_payload). progress None: a progress bar only on a terminal."""
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
                    await send_request(client, completion_payload(name, request, sampling), result, t0)
                bar.update()

            await asyncio.gather(*(arrive(*args) for args in zip(requests, arrivals, results, models)))
            duration = time.perf_counter() - t0
        timeline = await sampler.stop()
        after = await scrape_metrics(client)
    return BenchmarkRun(results, duration, timeline, before, after,
                        ([round(x, 2) for x in load_before], [round(x, 2) for x in os.getloadavg()]))
