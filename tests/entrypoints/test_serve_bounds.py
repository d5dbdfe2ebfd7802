"""Bounds of the server's second hardening pass: the waiting queue counts sequences (prompts x n), not requests; the
dashboard's event streams are capped and dropped when their client stops reading; the open utility routes'
tokenizer work has its own bounded pool (503 past it) and --api-key-utility-routes can guard them. Against a real
`pagedllm serve` on the tiny model where it is about the server; the pieces in-process where a real socket cannot
be made to block quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI

from pagedllm.bench.server_process import ServerProcess as Server
from pagedllm.config import ServerConfig
from pagedllm.engine.protocol import QueueFullError, TooManySequencesError
from pagedllm.engine.replica_pool import ReplicaPool
from pagedllm.entrypoints.openai.dashboard import DashboardHub, EventStreamResponse
from pagedllm.entrypoints.openai.errors import UTILITY_ROUTES, APIError, ApiKeyMiddleware
from pagedllm.entrypoints.openai.limits import WorkerPool

REPO = Path(__file__).resolve().parents[2]
MAX_WAITING = 4
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two sequences run at once, four may wait, two dashboard pages."""
    log = tmp_path_factory.mktemp("serve-bounds") / "server.log"
    argv = ["--model", tiny_model_dir, "--dtype", "float32", "--threads", "1", "--num-blocks", "400",
            "--max-model-len", "2048", "--max-num-seqs", "2", "--max-waiting-requests", str(MAX_WAITING),
            "--max-dashboard-streams", "2", "--stream-send-timeout", "2"]
    with Server(argv, str(log), timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}) as s:
        yield s


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


# ---- the queue bound counts sequences ------------------------------------------------------------------------------
def test_a_request_alone_over_the_bound_is_a_400_naming_the_flag(server: Server) -> None:
    for body in ({"prompt": "hi", "n": MAX_WAITING + 1}, {"prompt": ["a", "b", "c"], "n": 2},
                 {"prompt": ["x"] * 256, "n": 128}):
        r = httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert error_of(r)["code"] == "too_many_sequences" and "--max-waiting-requests" in error_of(r)["message"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "n": MAX_WAITING + 1, "max_tokens": 2})
    assert chat.status_code == 400 and error_of(chat)["param"] == "n"
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4  # exactly the bound: admitted


def test_waiting_sequences_not_requests_fill_the_queue(server: Server) -> None:
    """Two sequences run (a long n=2 request); then requests adding 2 + 2 waiting sequences fill the 4 seats, and a
    single one more is refused with 503 + Retry-After (counting requests, it would have been the third of four)."""

    async def run() -> tuple[int, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json={"prompt": "run", "n": 2, "stream": True,
                                                                      **LONG}) as running:
                lines = running.aiter_lines()  # kept: a collected iterator would close the stream (an abort)
                async for line in lines:  # its first token: both its sequences are running
                    if line.startswith("data: "):
                        break
                async with contextlib.AsyncExitStack() as waiting:
                    for prompt, extra in (("wait one", {"n": 2}), (["wait", "two"], {})):
                        # a stream's headers come once its request is admitted
                        r = await waiting.enter_async_context(client.stream("POST", "/v1/completions", json={
                            "prompt": prompt, "stream": True, **LONG, **extra}))
                        assert r.status_code == 200
                    refused = await client.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
                return running.status_code, refused

    status, refused = asyncio.run(run())
    assert status == 200
    assert refused.status_code == 503, refused.text
    assert error_of(refused)["code"] == "server_overloaded" and refused.headers["Retry-After"] == "1"
    assert "4 sequences are already waiting" in error_of(refused)["message"]
    wait_idle(server)
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "after", "max_tokens": 2},
                      timeout=60).status_code == 200


def gauge(text: str, name: str) -> float | None:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"pagedllm:{name}{{")]
    return sum(values) if values else None


async def wait_for_waiting(client: httpx.AsyncClient, requests: int) -> None:
    """Until the engine reports `requests` waiting requests (bounded: 600 polls)."""
    for _ in range(600):
        if (gauge((await client.get("/metrics")).text, "num_requests_waiting") or 0) >= requests:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the requests never waited")


def wait_idle(server: Server) -> None:
    for _ in range(600):
        text = httpx.get(f"{server.url}/metrics").text
        if gauge(text, "num_requests_running") == 0 and gauge(text, "num_requests_waiting") == 0:
            return
        threading.Event().wait(0.1)
    raise AssertionError("the server never went idle")


class FakePoolStream(SimpleNamespace):
    pass


def test_replica_pool_admission_counts_sequences_too() -> None:
    """The shared check over a ReplicaPool's streams: those without output count their n; a delivered one none."""
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.max_waiting_requests = 8
    pool.replicas = [SimpleNamespace(healthy=True)]
    pool.streams = {"a": FakePoolStream(params=SimpleNamespace(n=4), delivered=False),
                    "b": FakePoolStream(params=SimpleNamespace(n=16), delivered=True)}
    assert pool.num_waiting_seqs == 4
    pool.check_admission(4)
    with pytest.raises(QueueFullError, match="4 sequences are already waiting and this request adds 5"):
        pool.check_admission(5)
    with pytest.raises(TooManySequencesError, match="--max-waiting-requests"):
        pool.check_admission(9)


# ---- dashboard streams -------------------------------------------------------------------------------------------
def test_dashboard_streams_are_capped(server: Server) -> None:
    """Two pages may stream; the third gets a 503 naming the flag; a page that leaves frees its seat."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("GET", "/dashboard/events") as first, client.stream("GET", "/dashboard/events") as second:
            # the line iterators are kept: one garbage-collected mid-stream closes its connection (httpcore)
            readers = [page.iter_lines() for page in (first, second)]
            for page, lines in zip((first, second), readers):
                assert page.status_code == 200 and next(lines).startswith("data: ")
            with client.stream("GET", "/dashboard/events") as third:  # a stream: a failure here must not hang
                assert third.status_code == 503
                third.read()
            assert error_of(third)["code"] == "too_many_streams"
            assert "--max-dashboard-streams" in error_of(third)["message"]
        for _ in range(100):  # the two left: a new page is served again
            with client.stream("GET", "/dashboard/events") as again:
                if again.status_code == 200:
                    break
            threading.Event().wait(0.1)
        assert again.status_code == 200


def test_an_unread_dashboard_stream_is_dropped_and_unsubscribed() -> None:
    """A page whose sends block (its client reads nothing) is dropped after the send timeout, its seat freed; a page
    that reads keeps streaming."""
    hub = DashboardHub("m", max_streams=2, send_timeout=0.3)

    async def page(blocked: bool) -> list[bytes]:
        sent: list[bytes] = []

        async def send(message: dict) -> None:
            if blocked and message.get("body"):
                await asyncio.sleep(3600)  # a full socket
            sent.append(message.get("body", b""))

        async def receive() -> dict:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        response = EventStreamResponse(hub, hub.subscribe())
        task = asyncio.ensure_future(response({"type": "http", "path": "/dashboard/events",
                                               "asgi": {"spec_version": "2.4"}}, receive, send))
        await asyncio.sleep(1.0)
        assert task.done() == blocked  # the blocked page ended by itself, without raising
        if blocked:
            task.result()
        else:
            assert len(hub.subscribers) == 1  # only the reading page is still subscribed
            task.cancel()
        return sent

    async def main() -> tuple[list[bytes], list[bytes]]:
        return await asyncio.gather(page(True), page(False))

    blocked, reading = asyncio.run(main())
    assert not hub.subscribers
    assert b"data: " in b"".join(reading) and not any(blocked[1:])  # the blocked page sent nothing past its start


def test_the_full_frame_is_built_once_per_snapshot() -> None:
    hub = DashboardHub("m")
    builds = []
    hub.build_full_frame = lambda: builds.append(1) or json.dumps({"n": len(builds)})  # type: ignore[method-assign]
    frames = {hub.full_frame() for _ in range(50)}
    hub.num_snapshots += 1
    frames.add(hub.full_frame())
    assert len(builds) == 2 and len(frames) == 2


# ---- the utility routes ------------------------------------------------------------------------------------------
def test_a_tokenize_flood_gets_503s_and_completions_go_on(server: Server) -> None:
    """48 concurrent /tokenize calls of 120,000 characters each: past the utility pool's 8 jobs they get 503 at
    once; every one admitted answers 200, and a long-prompt completion sent meanwhile (the generating routes' own
    pool) succeeds."""
    text = "lorem ipsum dolor sit amet " * 4500

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            flood = [asyncio.create_task(client.post("/tokenize", json={"prompt": text})) for _ in range(48)]
            await asyncio.sleep(0.2)
            completion = await client.post("/v1/completions", json={"prompt": "hello world " * 800,
                                                                          "max_tokens": 2})
            return list(await asyncio.gather(*flood)), completion

    flood, completion = asyncio.run(run())
    statuses = [r.status_code for r in flood]
    assert completion.status_code == 200, completion.text
    assert set(statuses) == {200, 503}, statuses
    refused = next(r for r in flood if r.status_code == 503)
    assert error_of(refused)["code"] == "server_overloaded" and refused.headers["Retry-After"] == "1"
    assert all(r.json()["count"] > 0 for r in flood if r.status_code == 200)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 2, 3]}).status_code == 200


def test_worker_pool_bounds_its_jobs_and_frees_them_when_they_end() -> None:
    """With max_pending, the next job past the bound is a 503 at once; a seat frees when its job ends, even if its
    caller gave up waiting."""
    pool = WorkerPool(1, max_pending=2, name="test-utility")
    gate = threading.Event()

    async def main() -> None:
        jobs = [asyncio.ensure_future(pool.run(gate.wait, 10)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await pool.run(lambda: 1)
        assert refused.value.status == 503
        jobs[1].cancel()  # a caller leaves: its job still holds a seat until it has run
        with pytest.raises(APIError):
            await pool.run(lambda: 1)
        gate.set()
        await jobs[0]
        for _ in range(100):
            try:
                assert await pool.run(lambda: 7) == 7
                return
            except APIError:
                await asyncio.sleep(0.02)
        raise AssertionError("the seats were never freed")

    try:
        asyncio.run(main())
    finally:
        gate.set()
        pool.shutdown()


def test_api_key_can_guard_the_utility_routes() -> None:
    app = FastAPI()
    for path in ("/tokenize", "/detokenize", "/v1/models", "/health", "/metrics"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET"])

    def statuses(also: tuple[str, ...], headers: dict[str, str] | None = None) -> dict[str, int]:
        guarded = ApiKeyMiddleware(app, api_key="k", also=also)

        async def run() -> dict[str, int]:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(guarded), base_url="http://t") as client:
                return {p: (await client.get(p, headers=headers)).status_code
                        for p in ("/tokenize", "/detokenize", "/v1/models", "/health", "/metrics")}

        return asyncio.run(run())

    assert statuses(()) == {"/tokenize": 200, "/detokenize": 200, "/v1/models": 401, "/health": 200, "/metrics": 200}
    assert statuses(UTILITY_ROUTES) == {"/tokenize": 401, "/detokenize": 401, "/v1/models": 401, "/health": 200,
                                        "/metrics": 200}
    assert set(statuses(UTILITY_ROUTES, {"Authorization": "Bearer k"}).values()) == {200}
    with pytest.raises(ValueError, match="--api-key-utility-routes needs an API key"):
        ServerConfig(api_key_utility_routes=True)
