"""`pagedllm bench soak`: a server under mixed load for a long time, to see that it neither breaks nor grows.

It launches `pagedllm serve` (or uses --base-url), then keeps `--concurrency` clients busy for `--duration` seconds
with a mix of completions, chats, seeded sampling, streams read to the end, streams and waits cut by their client,
and bad requests (a seed torch refuses, a lone surrogate, an unknown chat role, a body over the size limit, broken
JSON). It reports the responses by kind and status, the errors that should not happen (5xx, dropped connections,
a bad request accepted), the server's RSS over time (start, after warm-up, middle, end), p50/p99 latency per minute,
and the server's state once the load stops (running, waiting, KV blocks in use): one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from pagedllm.bench.server_process import ServerProcess, fetch_model_card

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum an old song about rivers "
         "mountains cities numbers 1 2 3 and colours red green blue").split()
# kind -> weight; "bad_*" kinds must get a 4xx, the others a 2xx (503 with Retry-After counts as overload)
MIX = {"completion": 20, "chat": 15, "seeded": 10, "stream": 20, "stream_abort": 10, "wait_abort": 5,
       "bad_seed": 4, "bad_surrogate": 4, "bad_role": 4, "bad_json": 3, "bad_too_large": 2, "health": 3}


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class SoakStats:
    """Everything the clients saw, by kind: status counts, unexpected outcomes, latencies per minute."""

    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    unexpected: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    latencies: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    rss: list[tuple[float, int]] = field(default_factory=list)

    def record(self, kind: str, outcome: str, ok: bool, start: float, t0: float, latency: float | None) -> None:
        self.statuses[kind][outcome] += 1
        if not ok:
            self.unexpected[kind][outcome] += 1
        if ok and latency is not None:
            self.latencies[int((start - t0) // 60)].append(latency)


def prompt(rng: random.Random, lo: int = 4, hi: int = 120) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


async def one_request(http: httpx.AsyncClient, kind: str, model: str, rng: random.Random,
                      max_request_bytes: int) -> tuple[str, bool, bool]:
    """Send one request of `kind`; (outcome, as expected?, counts for latency?)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt(rng), "max_tokens": rng.randint(8, 64)}
    chat = {"model": model, "messages": [{"role": "user", "content": prompt(rng, 2, 40)}],
            "max_tokens": rng.randint(8, 48)}
    if kind == "health":
        r = await http.get("/health")
        return str(r.status_code), r.status_code == 200, False
    if kind.startswith("bad_"):
        content = {"bad_seed": json.dumps({**body, "seed": 10**30}),
                   "bad_surrogate": json.dumps({"model": model, "prompt": "\ud800 hi"}),  # escaped as \ud800
                   "bad_role": json.dumps({**chat, "messages": [{"role": "wizard", "content": "hi"}]}),
                   "bad_json": '{"prompt": "hi", "max_tokens": ',
                   "bad_too_large": json.dumps({**body, "prompt": "a " * (max_request_bytes // 2 + 1)})}[kind]
        path = "/v1/chat/completions" if kind == "bad_role" else "/v1/completions"
        r = await http.post(path, content=content, headers={"Content-Type": "application/json"})
        return str(r.status_code), 400 <= r.status_code < 500 and "error" in r.json(), False
    if kind in ("completion", "chat", "seeded"):
        if kind == "seeded":
            body.update(temperature=1.0, seed=rng.randint(-(2**63), 2**63 - 1), n=rng.randint(1, 3))
        path, payload = ("/v1/chat/completions", chat) if kind == "chat" else ("/v1/completions", body)
        r = await http.post(path, json=payload)
        return str(r.status_code), r.status_code == 200 or overloaded(r), r.status_code == 200
    if kind == "wait_abort":  # a client that gives up while it waits
        try:
            await http.post("/v1/completions", json={**body, "max_tokens": 200, "ignore_eos": True},
                            timeout=httpx.Timeout(60, read=rng.uniform(0.05, 1.0)))
            return "finished", True, False
        except httpx.ReadTimeout:
            return "client_gave_up", True, False
    cut = rng.randint(1, 8) if kind == "stream_abort" else None
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code), overloaded(r), False
        chunks, done = 0, False
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                chunks += 1
                done = line == "data: [DONE]"
                if '"error"' in line:  # which error, by its code (or type): the one thing to look up afterwards
                    return f"error_event:{error_code(line[5:])}", False, False
            if cut is not None and chunks >= cut:
                return "client_cut", True, False
        return ("200" if done else "no_done"), done, cut is None and done


def error_code(event: str) -> str:
    """The code (or type) of a stream's error event; "unreadable" if it is not the JSON it should be."""
    try:
        error = json.loads(event).get("error") or {}
        return str(error.get("code") or error.get("type"))
    except (json.JSONDecodeError, AttributeError):
        return "unreadable"


def overloaded(r: httpx.Response) -> bool:
    return r.status_code == 503 and "Retry-After" in r.headers


async def client_loop(http: httpx.AsyncClient, model: str, seed: int, stop_at: float, t0: float, stats: SoakStats,
                      max_request_bytes: int) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items())
    while time.monotonic() < stop_at:
        kind = rng.choices(kinds, weights)[0]
        start = time.monotonic()
        try:
            outcome, ok, timed = await one_request(http, kind, model, rng, max_request_bytes)
        except httpx.HTTPError as e:
            outcome, ok, timed = type(e).__name__, False, False
        stats.record(kind, outcome, ok, start, t0, time.monotonic() - start if timed else None)


async def sample_rss(pid: int | None, stop_at: float, t0: float, stats: SoakStats, interval: float) -> None:
    while pid is not None and time.monotonic() < stop_at:
        stats.rss.append((time.monotonic() - t0, rss_bytes(pid)))
        await asyncio.sleep(interval)


async def final_state(http: httpx.AsyncClient) -> dict[str, float]:
    """The server's gauges once the load stopped and its requests drained (or 30 s passed)."""
    names = {"num_requests_running", "num_requests_waiting", "kv_blocks_in_use", "kv_blocks_cached_free",
             "engine_restarts_total"}
    state: dict[str, float] = {}
    for _ in range(60):
        text = (await http.get("/metrics")).text
        state = {line.split("{")[0].removeprefix("pagedllm:"): float(line.rsplit(" ", 1)[1])
                 for line in text.splitlines() if line.startswith("pagedllm:")
                 and line.split("{")[0].removeprefix("pagedllm:") in names}
        if not state.get("num_requests_running") and not state.get("num_requests_waiting"):
            break
        await asyncio.sleep(0.5)
    return state


def rss_at(series: list[tuple[float, int]], t: float) -> int:
    return min(series, key=lambda p: abs(p[0] - t))[1]


def summarize(stats: SoakStats, duration: float, warmup: float, state: dict[str, float],
              config: dict[str, Any]) -> dict[str, Any]:
    per_minute = [{"minute": m, "requests": len(v), "p50_s": float(np.percentile(v, 50)),
                   "p99_s": float(np.percentile(v, 99))} for m, v in sorted(stats.latencies.items())]
    rss: dict[str, Any] = {}
    if stats.rss:
        start, warm, mid, end = (rss_at(stats.rss, t) for t in (0, warmup, (warmup + duration) / 2, duration))
        rss = {"start_mib": start / 2**20, "after_warmup_mib": warm / 2**20, "middle_mib": mid / 2**20,
               "end_mib": end / 2**20, "growth_after_warmup": end / warm - 1,
               "series": [(round(t, 1), round(b / 2**20, 1)) for t, b in stats.rss]}
    return {"config": config, "responses": {k: dict(v) for k, v in stats.statuses.items()},
            "unexpected": {k: dict(v) for k, v in stats.unexpected.items()},
            "num_requests": sum(sum(v.values()) for v in stats.statuses.values()),
            "num_unexpected": sum(sum(v.values()) for v in stats.unexpected.values()),
            "latency_per_minute": per_minute, "rss": rss, "server_after": state}


async def run_soak(base_url: str, pid: int | None, duration: float, warmup: float, concurrency: int, seed: int,
                   max_request_bytes: int, rss_interval: float, config: dict[str, Any]) -> dict[str, Any]:
    stats = SoakStats()
    model = fetch_model_card(base_url)["id"]
    t0 = time.monotonic()
    stop_at = t0 + duration
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        await asyncio.gather(sample_rss(pid, stop_at, t0, stats, rss_interval),
                             *(client_loop(http, model, seed * 1000 + i, stop_at, t0, stats, max_request_bytes)
                               for i in range(concurrency)))
        if pid is not None:
            stats.rss.append((time.monotonic() - t0, rss_bytes(pid)))
        state = await final_state(http)
    return summarize(stats, duration, warmup, state, config)


def cmd_soak(args: argparse.Namespace) -> int:
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(python=platform.python_version(), cpus=os.cpu_count())
    server_argv = shlex.split(args.server_args)
    max_bytes = args.max_request_bytes

    def run(url: str, pid: int | None) -> dict[str, Any]:
        return asyncio.run(run_soak(url, pid, args.duration, args.warmup, args.concurrency, args.seed, max_bytes,
                                    args.rss_interval, config))

    if args.base_url:
        result = run(args.base_url, args.server_pid)
    else:
        log = args.server_log or os.path.join(tempfile.mkdtemp(prefix="pagedllm-soak-"), "server.log")
        print(f"launching pagedllm serve {' '.join(server_argv)} (log: {log})", file=sys.stderr)
        argv = [*server_argv, "--disable-log-requests", "--max-request-bytes", str(max_bytes)]
        with ServerProcess(argv, log) as server:
            result = run(server.url, server.proc.pid)
        result["server_log"] = log
    text = json.dumps(result, indent=2)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    brief = {k: v for k, v in result.items() if k not in ("config",)}
    brief["rss"] = {k: v for k, v in result["rss"].items() if k != "series"}
    print(json.dumps(brief, indent=2))
    return 0 if result["num_unexpected"] == 0 else 1


def add_command(sub: argparse._SubParsersAction) -> None:
    """`pagedllm bench soak`."""
    p = sub.add_parser("soak", help="mixed load with aborts and bad requests for a long time: errors by kind, "
                                    "server RSS over time, p50/p99 latency per minute")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=60.0, help="RSS growth is measured from this many seconds in")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending requests back to back")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="flags for the launched `pagedllm serve` (quoted)")
    p.add_argument("--max-request-bytes", type=int, default=2 << 20, help="the server's, for the oversize request")
    p.add_argument("--base-url", default=None, help="soak a running server instead of launching one")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: its pid, for RSS")
    p.add_argument("--server-log", default=None)
    p.add_argument("--rss-interval", type=float, default=5.0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_soak)
