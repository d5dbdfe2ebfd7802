"""What the dashboard costs replicas under --data-parallel-size: output tokens/s and the replicas' CPU time per output
token, for a server with --no-dashboard and one with the dashboard, without and with a page open on every replica
(an event-stream reader per replica: the page's data path, without a browser's own CPU on this machine). Runs
alternate (the order reversed every other round) so that the machine's drift hits each configuration alike.

    PYTHONPATH=. python docs/scripts/dashboard_dp_overhead.py --model tests/.../tiny --rounds 2
    PYTHONPATH=. python docs/scripts/dashboard_dp_overhead.py --rounds 2      # the default model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading

import httpx

from pagedllm.bench.client import run_benchmark
from pagedllm.bench.datasets import sample_requests
from pagedllm.bench.server_process import ServerProcess, fetch_model_card
from pagedllm.bench.summary import summarize
from pagedllm.engine.replica_pool import LOCAL_RAY_ENV
from pagedllm.model.loader import load_tokenizer

TICKS = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (the server's local Ray: raylet, workers, the replicas' actors)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except OSError:
        return 0.0


def replica_pids(server_pid: int) -> list[int]:
    pids = []
    for pid in descendants(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"EngineReplica" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


class PageReaders:
    """One /dashboard/events reader per replica, in threads, counting frames and bytes until stopped."""

    def __init__(self, url: str, replicas: int) -> None:
        self.url, self.frames, self.bytes, self.stop = url, 0, 0, threading.Event()
        self.threads = [threading.Thread(target=self.read, args=(i,), daemon=True) for i in range(replicas)]

    def read(self, replica: int) -> None:
        with httpx.stream("GET", f"{self.url}/dashboard/events", params={"replica": replica}, timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.frames += 1
                    self.bytes += len(line)
                if self.stop.is_set():
                    return

    def __enter__(self) -> PageReaders:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def measure(server: ServerProcess, model: str, requests: list, page: bool) -> dict:
    replicas = replica_pids(server.proc.pid)
    headlines = lambda: httpx.get(f"{server.url}/dashboard/info", timeout=10).json().get("replicas", [])  # noqa: E731
    dashboard = httpx.get(f"{server.url}/dashboard/info", timeout=10).status_code == 200
    snaps0 = [h["snapshots"] for h in headlines()] if dashboard else []
    cpu0 = [cpu_seconds(p) for p in replicas] + [cpu_seconds(server.proc.pid)]
    readers = PageReaders(server.url, 2) if page else None
    if readers:
        readers.__enter__()
    try:
        result = summarize(asyncio.run(run_benchmark(server.url, model, requests, [0.0] * len(requests),
                                                     sample_interval=0)), float("inf"))
    finally:
        if readers:
            readers.__exit__()
    cpu1 = [cpu_seconds(p) for p in replicas] + [cpu_seconds(server.proc.pid)]
    tokens = result["total_output_tokens"] if "total_output_tokens" in result else None
    used = [b - a for a, b in zip(cpu0, cpu1)]
    row = {"output_tokens_per_s": result["output_tokens_per_s"], "duration_s": result.get("duration_s"),
           "num_failed": result["num_failed"], "replica_cpu_s": round(sum(used[:-1]), 2),
           "server_cpu_s": round(used[-1], 2), "num_replica_processes": len(replicas),
           "loadavg_before": result["loadavg_before"], "loadavg_after": result["loadavg_after"]}
    if tokens:
        row["replica_cpu_ms_per_token"] = round(1000 * sum(used[:-1]) / tokens, 3)
    if dashboard:
        row["snapshots"] = [b - a for a, b in zip(snaps0, [h["snapshots"] for h in headlines()])]
    if readers:
        row["page_frames"], row["page_kb"] = readers.frames, round(readers.bytes / 1024, 1)
    return row


def run_server(name: str, argv: list[str], requests: list, pages: list[bool], log_dir: str) -> list[dict]:
    env = {**os.environ, **LOCAL_RAY_ENV}
    rows = []
    with ServerProcess(argv, os.path.join(log_dir, name + ".log"), 900, env) as server:
        model = fetch_model_card(server.url)["id"]
        asyncio.run(run_benchmark(server.url, model, requests[:4], [0.0] * 4))  # warm-up
        for page in pages:
            row = {"config": name + (", page open" if page else ""), **measure(server, model, requests, page)}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-args", default="--threads 1 --data-parallel-size 2 --kv-cache-memory 256MiB")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    tokenizer = load_tokenizer(args.model)
    requests = sample_requests("random", tokenizer, args.num_prompts, 0, input_len=args.input_len,
                               output_len=args.output_len)
    base = (["--model", args.model] if args.model else []) + args.server_args.split()
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        for r in range(args.rounds):
            order = [("no-dashboard", ["--no-dashboard"], [False]), ("dashboard", [], [False, True])]
            for name, extra, pages in (order if r % 2 == 0 else order[::-1]):
                rows += run_server(name, base + extra, requests, pages if r % 2 == 0 else pages[::-1], log_dir)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
