"""`pagedllm bench fairness`: who waits on a shared server. A heavy client queues many long requests at once while a
few light interactive clients each send a short request, wait for it, think, and send the next. For each
--scheduling-policy (fcfs, priority, fair) it launches a server and reports every client's tokens/s and p50/p99 time
to first token, the total throughput, and the largest service gap between two backlogged clients (what VTC bounds):
as the clients saw it, and as the server's engine recorded it (`serve --service-trace`), beside the paper's bound.
The light clients are first run alone on an idle server: the TTFT the others are compared with.

The heavy client sends `user: heavy` and priority 1; light client i sends `user: light{i}` and priority 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from pagedllm.bench.client import RequestResult, http_client, send_request
from pagedllm.bench.results import write_json
from pagedllm.bench.server_process import ServerProcess, engine_actions, fetch_model_card, passthrough_argv
from pagedllm.config import SCHEDULING_POLICIES, EngineConfig
from pagedllm.core.fairness import INPUT_WEIGHT, OUTPUT_WEIGHT, max_service_gap
from pagedllm.core.service import service_bound
from pagedllm.entrypoints.service_trace import read_service_trace

SERVER_FLAGS = ["--disable-log-requests", "--uvicorn-log-level", "warning"]
VOCAB_RANGE = (1000, 40000)  # prompt token ids: ordinary tokens of the default tokenizer


@dataclass
class Workload:
    heavy_requests: int = 32
    heavy_concurrency: int = 0  # the heavy client's requests in flight at most (0: all at once)
    heavy_input_len: int = 256
    heavy_output_len: int = 64
    light_clients: int = 3
    light_input_len: int = 64
    light_output_len: int = 16
    think_s: float = 1.0
    idle_s: float = 20.0  # the light clients alone, for their idle TTFT
    seed: int = 0


@dataclass
class Sent:
    """One request as its client saw it."""

    client: str
    result: RequestResult


def payload(model: str, rng: random.Random, input_len: int, output_len: int, client: str,
            priority: int) -> dict[str, Any]:
    return {"model": model, "prompt": [rng.randrange(*VOCAB_RANGE) for _ in range(input_len)],
            "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "user": client, "priority": priority}


async def send(http: aiohttp.ClientSession, body: dict[str, Any], client: str, t0: float, log: list[Sent]) -> None:
    sent = Sent(client, RequestResult(len(body["prompt"])))
    log.append(sent)
    await send_request(http, body, sent.result, t0)


async def light_client(http: aiohttp.ClientSession, model: str, w: Workload, index: int, t0: float,
                       stop: asyncio.Event, log: list[Sent], idle: bool) -> None:
    """Send, wait for the answer, think, repeat until `stop`; every client sends at least once (a heavy batch that
    ends before a staggered start would leave it without a figure). The idle run's prompts differ from the contended
    run's: on the same server, prompts sent again would hit the prefix cache and make the second run look faster."""
    rng = random.Random((w.seed * 1000 + index + 1) * 2 + idle)
    name = f"light{index}"
    await asyncio.sleep(w.think_s * index / max(1, w.light_clients))  # staggered starts
    while True:
        await send(http, payload(model, rng, w.light_input_len, w.light_output_len, name, 0), name, t0, log)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), w.think_s)
        if stop.is_set():
            return


async def heavy_client(http: aiohttp.ClientSession, model: str, w: Workload, rng: random.Random, t0: float,
                       log: list[Sent]) -> None:
    """The heavy batch: every request at once, or at most `heavy_concurrency` in flight (a job sending long prompts
    one at a time holds a single seat, within its share, yet each prompt is a lot of work)."""
    slots = asyncio.Semaphore(w.heavy_concurrency or w.heavy_requests)

    async def one(body: dict[str, Any]) -> None:
        async with slots:
            await send(http, body, "heavy", t0, log)

    bodies = [payload(model, rng, w.heavy_input_len, w.heavy_output_len, "heavy", 1) for _ in range(w.heavy_requests)]
    await asyncio.gather(*map(one, bodies))


async def run_clients(base_url: str, model: str, w: Workload, heavy: bool, duration_s: float | None) -> dict:
    """The light clients (and, with `heavy`, the heavy client's whole batch at t = 0) until the heavy batch is done,
    or for `duration_s`. Returns what each request saw and the wall time."""
    log: list[Sent] = []
    stop = asyncio.Event()
    rng = random.Random(w.seed)
    async with http_client(base_url, None) as http:
        since = time.time()  # the service trace's clock
        t0 = time.perf_counter()
        lights = [asyncio.create_task(light_client(http, model, w, i, t0, stop, log, idle=not heavy))
                  for i in range(w.light_clients)]
        if heavy:
            await heavy_client(http, model, w, rng, t0, log)
        else:
            await asyncio.sleep(duration_s or w.idle_s)
        stop.set()
        await asyncio.gather(*lights)
        return {"log": log, "duration_s": time.perf_counter() - t0, "since": since}


def token_times(r: RequestResult) -> list[float]:
    """When each chunk arrived (seconds from the run's start): the first at TTFT, then after every gap."""
    if r.ttft_s is None:
        return []
    return list(r.start_s + r.ttft_s + np.cumsum([0.0, *r.itl_s]))


def service_samples(log: list[Sent], end_s: float, step_s: float = 0.1) -> list[tuple[dict, set]]:
    """Each client's weighted service over time (its prompt when its first token came, each output token after) and
    who had a request waiting for its first token: the trace VTC's bound is about."""
    samples = []
    times = {id(s): token_times(s.result) for s in log}
    for t in np.arange(0.0, end_s + step_s, step_s):
        served: dict[str, float] = {}
        backlogged: set[str] = set()
        for s in log:
            r, chunks = s.result, times[id(s)]
            got = sum(1 for c in chunks if c <= t)
            tokens = r.output_tokens * got / len(chunks) if chunks else 0.0
            served[s.client] = served.get(s.client, 0.0) + (INPUT_WEIGHT * r.prompt_len if got else 0.0) \
                + OUTPUT_WEIGHT * tokens
            if r.start_s <= t and not got and r.error is None:
                backlogged.add(s.client)
        samples.append((served, backlogged))
    return samples


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def client_rows(log: list[Sent], duration_s: float) -> list[dict[str, Any]]:
    rows = []
    for client in sorted({s.client for s in log}):
        results = [s.result for s in log if s.client == client]
        ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
        tokens = sum(r.output_tokens for r in results if r.error is None)
        rows.append({"client": client, "requests": len(results), "failed": sum(r.error is not None for r in results),
                     "output_tokens": tokens, "tokens_per_s": round(tokens / duration_s, 2),
                     "p50_ttft_s": percentile(ttfts, 50), "p99_ttft_s": percentile(ttfts, 99)})
    return rows


def service_bound_of(w: Workload, max_num_seqs: int) -> float:
    """VTC's 2·max(w_p·L_input, w_q·M), M the tokens the running batch can hold: its seats x the longest request."""
    seats = min(max_num_seqs, w.heavy_requests + w.light_clients)
    longest = max(w.heavy_input_len + w.heavy_output_len, w.light_input_len + w.light_output_len)
    return service_bound(max(w.heavy_input_len, w.light_input_len), seats * longest)


def summarize(policy: str, run: dict, trace: str | None = None, bound: float | None = None) -> dict[str, Any]:
    """A run's figures; with the server's service trace, the gap the engine recorded over the run too."""
    log, duration = run["log"], run["duration_s"]
    engine_gap = max_service_gap(read_service_trace(trace, run["since"])) if trace and os.path.exists(trace) else None
    light_ttfts = [s.result.ttft_s for s in log if s.client != "heavy" and s.result.ttft_s is not None]
    total = sum(s.result.output_tokens for s in log if s.result.error is None)
    return {"policy": policy, "duration_s": round(duration, 2), "total_tokens_per_s": round(total / duration, 2),
            "light_p50_ttft_s": percentile(light_ttfts, 50), "light_p99_ttft_s": percentile(light_ttfts, 99),
            "max_service_gap": round(max_service_gap(service_samples(log, duration)), 1),
            "engine_max_service_gap": None if engine_gap is None else round(engine_gap, 1), "service_bound": bound,
            "max_input_len": max((s.result.prompt_len for s in log), default=0),
            "loadavg_after": [round(x, 2) for x in os.getloadavg()], "clients": client_rows(log, duration)}


def run_policy(policy: str, argv: list[str], w: Workload, log_dir: str, timeout: float, idle: bool,
               bound: float) -> list[dict]:
    """Launch a server under `policy` (recording its service trace); the idle run first if asked, then the
    contended one."""
    log_path = os.path.join(log_dir, f"server-{policy}.log")
    trace = os.path.join(log_dir, f"service-{policy}.jsonl")
    print(f"[{policy}] launching the server (log: {log_path})", file=sys.stderr)
    out = []
    with ServerProcess([*argv, "--scheduling-policy", policy, "--service-trace", trace], log_path, timeout) as server:
        model = fetch_model_card(server.url)["id"]
        if idle:
            out.append(summarize("idle", asyncio.run(run_clients(server.url, model, w, False, w.idle_s))))
            print(f"[idle] light p99 TTFT {out[-1]['light_p99_ttft_s']} s", file=sys.stderr)
        out.append(summarize(policy, asyncio.run(run_clients(server.url, model, w, True, None)), trace, bound))
        print(f"[{policy}] light p99 TTFT {out[-1]['light_p99_ttft_s']} s, total {out[-1]['total_tokens_per_s']} "
              "tok/s", file=sys.stderr)
    return out


def print_result(result: dict[str, Any]) -> None:
    print(f"{'run':<10}{'client':<10}{'requests':>9}{'tokens/s':>10}{'p50 TTFT s':>12}{'p99 TTFT s':>12}")
    for run in result["runs"]:
        for row in run["clients"]:
            print(f"{run['policy']:<10}{row['client']:<10}{row['requests']:>9}{row['tokens_per_s']:>10.2f}"
                  f"{row['p50_ttft_s'] or '-'!s:>12}{row['p99_ttft_s'] or '-'!s:>12}")
        print(f"{run['policy']:<10}{'(all)':<10}{'':>9}{run['total_tokens_per_s']:>10.2f}"
              f"{run['light_p50_ttft_s'] or '-'!s:>12}{run['light_p99_ttft_s'] or '-'!s:>12}"
              f"   light p50/p99 TTFT; max service gap {run['max_service_gap']} (clients), "
              f"{run['engine_max_service_gap'] if run['engine_max_service_gap'] is not None else '-'} (engine trace), "
              f"bound {run['service_bound'] if run['service_bound'] is not None else '-'}")


def cmd_fairness(args: argparse.Namespace, actions: Sequence[argparse.Action]) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in SCHEDULING_POLICIES for p in policies):
        raise ValueError(f"--policies must name some of {', '.join(SCHEDULING_POLICIES)}, got {args.policies!r}")
    w = Workload(args.heavy_requests, args.heavy_concurrency, args.heavy_input_len, args.heavy_output_len,
                 args.light_clients, args.light_input_len, args.light_output_len, args.think_time, args.idle_seconds,
                 args.seed)
    argv = passthrough_argv(args, [a for a in actions if a.dest != "scheduling_policy"]) + SERVER_FLAGS
    log_dir = args.server_log_dir or tempfile.mkdtemp(prefix="pagedllm-fairness-")
    os.makedirs(log_dir, exist_ok=True)
    load_before = os.getloadavg()
    runs: list[dict] = []
    try:
        for i, policy in enumerate(policies):
            runs += run_policy(policy, argv, w, log_dir, args.server_timeout, idle=i == 0 and w.idle_s > 0,
                               bound=service_bound_of(w, args.max_num_seqs))
    except RuntimeError as e:  # a server that would not start: its log says why
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = {"workload": vars(w), "server_argv": argv, "runs": runs,
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    print_result(result)
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fairness", help="a heavy client and light interactive ones on one server, per scheduling "
                                        "policy: each client's tokens/s and p50/p99 time to first token")
    p.add_argument("--policies", default="fcfs,priority,fair", help="comma-separated scheduling policies")
    d = Workload()
    g = p.add_argument_group("workload")
    g.add_argument("--heavy-requests", type=int, default=d.heavy_requests,
                   help="sent by the heavy client, all at once unless --heavy-concurrency")
    g.add_argument("--heavy-concurrency", type=int, default=d.heavy_concurrency,
                   help="the heavy client's requests in flight at most (0: all at once)")
    g.add_argument("--heavy-input-len", type=int, default=d.heavy_input_len)
    g.add_argument("--heavy-output-len", type=int, default=d.heavy_output_len)
    g.add_argument("--light-clients", type=int, default=d.light_clients)
    g.add_argument("--light-input-len", type=int, default=d.light_input_len)
    g.add_argument("--light-output-len", type=int, default=d.light_output_len)
    g.add_argument("--think-time", type=float, default=d.think_s, help="seconds a light client waits between requests")
    g.add_argument("--idle-seconds", type=float, default=d.idle_s,
                   help="the light clients alone first, for their idle TTFT (0: skip)")
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--server-log-dir", default=None)
    p.add_argument("--output-json", default=None)
    EngineConfig.add_cli_args(p)  # passed to every server (--scheduling-policy is the bench's); --seed seeds prompts
    p.set_defaults(func=functools.partial(cmd_fairness, actions=engine_actions()))
