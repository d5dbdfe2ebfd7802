"""What one connection can hold (entrypoints/http_limits.py), against a real uvicorn server process on 127.0.0.1 with
each of its parsers: a slowloris head gets 408 in seconds, an oversized head 431 without the server keeping it,
connections past the cap 503 while the others work, and a normal keep-alive client sees none of it.

Run as a script, this file is the server: `python test_connection_limits.py PARSER LIMITS_JSON|plain`.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import resource
import select
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from pagedllm.entrypoints.http_limits import (
    ConnectionLimits,
    GuardedH11Protocol,
    GuardedHttpToolsProtocol,
    default_max_connections,
    uvicorn_config_kwargs,
)

LIMITS = ConnectionLimits(max_header_bytes=16 * 1024, header_timeout=1.5, max_connections=24)
KEEP_ALIVE = 30  # seconds: longer than any test, so that only the guard closes connections
MiB = 1 << 20


# ---- the server (run in its own process) -----------------------------------------------------------------------
def serve(parser: str, limits: str) -> None:
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.post("/echo")
    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    @app.get("/connections")
    async def connections() -> PlainTextResponse:
        return PlainTextResponse(str(len(server.server_state.connections)))

    kwargs = {"http": parser} if limits == "plain" else uvicorn_config_kwargs(ConnectionLimits(**json.loads(limits)),
                                                                              parser)
    sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_keep_alive=KEEP_ALIVE, **kwargs))
    print(sock.getsockname()[1], flush=True)
    server.run(sockets=[sock])


class Server:
    def __init__(self, parser: str, limits: ConnectionLimits | None) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                              os.environ.get("PYTHONPATH", "")])}
        arg = "plain" if limits is None else json.dumps(asdict(limits))
        self.proc = subprocess.Popen([sys.executable, __file__, parser, arg], stdout=subprocess.PIPE, env=env,
                                     text=True)
        self.port = int(self.proc.stdout.readline())
        for _ in range(100):  # the socket listens already; wait until uvicorn answers on it
            with contextlib.suppress(OSError):
                if self.get("/health")[0] == 200:
                    break
            time.sleep(0.1)

    def get(self, path: str, conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
        conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def rss(self) -> int:
        fields = Path(f"/proc/{self.proc.pid}/status").read_text().split("VmRSS:")[1].split()
        return int(fields[0]) * 1024

    def wait_connections(self, n: int) -> None:
        """Until the server counts `n` connections besides the one asking (bounded)."""
        for _ in range(50):
            if int(self.get("/connections")[1]) == n + 1:
                return
            time.sleep(0.1)
        raise AssertionError(f"the server still counts {self.get('/connections')[1]} connections, not {n + 1}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request):
    srv = Server(request.param, LIMITS)
    yield srv
    srv.stop()


def read_until_close(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


HEAD = b"GET /health HTTP/1.1\r\nHost: test\r\n"


# ---- the tests -----------------------------------------------------------------------------------------------------
def test_slowloris_heads_get_408_in_seconds_while_health_answers(server):
    slow = [server.connect() for _ in range(8)]
    for sock in slow:
        sock.sendall(HEAD + b"X-Slow: ")
    idle = server.connect()  # opens and never sends
    answers: dict[socket.socket, bytes] = {}
    health = []
    start = time.monotonic()
    for _ in range(12):  # a byte per 0.5 s for 6 s at most: 4 header timeouts
        for sock in slow:
            if sock not in answers:
                with contextlib.suppress(OSError):
                    sock.sendall(b"a")
        readable, _, _ = select.select([s for s in [*slow, idle] if s not in answers], [], [], 0.5)
        for sock in readable:
            answers[sock] = read_until_close(sock)
        t0 = time.monotonic()
        health.append((server.get("/health")[0], time.monotonic() - t0))
        if len(answers) == len(slow) + 1:
            break
    elapsed = time.monotonic() - start
    assert len(answers) == len(slow) + 1, f"{len(slow) + 1 - len(answers)} connections still open after {elapsed:.1f} s"
    assert all(answers[s].startswith(b"HTTP/1.1 408 ") and b"--header-timeout" in answers[s] for s in slow)
    assert answers[idle] == b""  # closed without a word, as uvicorn closes an idle keep-alive connection
    assert all(status == 200 for status, _ in health)
    print(f"\nslowloris closed after {elapsed:.1f} s; /health max {max(t for _, t in health) * 1000:.0f} ms")


def test_a_pipelined_head_that_stalls_gets_408_after_the_answer_before_it(server):
    sock = server.connect()
    sock.sendall(HEAD + b"\r\n" + HEAD + b"X-Stalled: ")
    sock.settimeout(4 * LIMITS.header_timeout)
    answer = read_until_close(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 408 ") == 1, answer


def test_a_head_sent_slowly_but_in_time_is_served(server):
    sock = server.connect()
    for part in (b"GET /health HTTP/1.1\r\n", b"Host: test\r\nX-Part: 2\r\n", b"Connection: close\r\n\r\n"):
        sock.sendall(part)
        time.sleep(0.4)  # 1.2 s in all, within the 1.5 s header timeout
    assert read_until_close(sock).startswith(b"HTTP/1.1 200 ")


def test_an_oversized_head_gets_431_and_the_server_keeps_none_of_it(server):
    sock = server.connect()
    sock.sendall(HEAD + b"X-Big: " + b"a" * MiB + b"\r\n\r\n")
    answer = read_until_close(sock)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"--max-header-bytes" in answer

    before = server.rss()
    socks = [server.connect() for _ in range(16)]
    piece = b"a" * (64 * 1024)
    for sock in socks:
        with contextlib.suppress(OSError):  # the server may close before the last piece
            sock.sendall(HEAD + b"X-Big: ")
            for _ in range(16):
                sock.sendall(piece)
    grown = server.rss() - before  # measured with the clients' sockets still open
    answers = [read_until_close(sock) for sock in socks]
    assert all(a.startswith(b"HTTP/1.1 431 ") for a in answers)
    assert grown < 8 * MiB, f"16 x 1 MiB of unfinished headers grew the server by {grown / MiB:.1f} MiB"


def test_heads_just_under_the_limit_and_a_body_in_the_same_read_are_served(server):
    sock = server.connect()
    sock.sendall(HEAD + b"X-Fill: " + b"a" * (15 * 1024) + b"\r\nConnection: close\r\n\r\n")
    assert read_until_close(sock).startswith(b"HTTP/1.1 200 ")

    body = b"x" * (200 * 1024)  # head and body in one write: the head ends long before the limit is crossed
    sock = server.connect()
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    answer = read_until_close(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n204800")


def test_connections_past_the_cap_are_refused_and_accepted_again_once_others_close(server):
    server.wait_connections(0)
    held = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=5) for _ in range(LIMITS.max_connections)]
    for conn in held:
        assert server.get("/health", conn)[0] == 200
    for _ in range(3):
        sock = server.connect()
        sock.sendall(HEAD + b"\r\n")
        answer = read_until_close(sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer
        assert b"connection: close" in head and b"retry-after: 1" in head
        assert b"--max-connections" in json.loads(body)["error"]["message"].encode()
    assert all(server.get("/health", conn)[0] == 200 for conn in held)  # the held ones still work

    for conn in held[:2]:
        conn.close()
    for _ in range(50):  # until the server has seen the closes
        with contextlib.suppress(OSError, http.client.HTTPException):
            if server.get("/health")[0] == 200:
                break
        time.sleep(0.1)
    else:
        raise AssertionError("no connection accepted after two of the held ones closed")
    for conn in held[2:]:
        conn.close()


def test_a_keep_alive_client_is_unaffected(server):
    server.wait_connections(0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    assert server.get("/health", conn)[0] == 200
    first = conn.sock
    for i in range(300):
        if i % 3:
            assert server.get("/health", conn) == (200, b"ok")
        else:
            conn.request("POST", "/echo", body=b"y" * i)
            assert conn.getresponse().read() == str(i).encode()
    time.sleep(LIMITS.header_timeout + 0.5)  # idle between requests longer than the header timeout
    assert server.get("/health", conn) == (200, b"ok")
    assert conn.sock is first  # one connection throughout
    conn.close()

    sock = server.connect()  # three requests pipelined in one write
    sock.sendall(HEAD + b"\r\n" + HEAD + b"\r\n" + HEAD + b"Connection: close\r\n\r\n")
    assert read_until_close(sock).count(b"HTTP/1.1 200 ") == 3


def test_the_limits_are_checked_and_fill_uvicorn_config():
    assert default_max_connections() <= max(16, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)
    for bad in ({"max_header_bytes": 0}, {"header_timeout": -1.0}, {"max_connections": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            ConnectionLimits(**bad)
    parser = argparse.ArgumentParser()
    ConnectionLimits.add_cli_args(parser)
    args = parser.parse_args(["--max-header-bytes", "8192", "--header-timeout", "3", "--max-connections", "100"])
    assert ConnectionLimits.from_cli_args(args) == ConnectionLimits(8192, 3.0, 100)
    assert ConnectionLimits.from_cli_args(parser.parse_args([])) == ConnectionLimits()
    kwargs = uvicorn_config_kwargs(LIMITS, "h11")
    assert kwargs["http"].func is GuardedH11Protocol and kwargs["http"].keywords == {"limits": LIMITS}
    assert kwargs["h11_max_incomplete_event_size"] == LIMITS.max_header_bytes
    assert uvicorn_config_kwargs(LIMITS)["http"].func is GuardedHttpToolsProtocol


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
