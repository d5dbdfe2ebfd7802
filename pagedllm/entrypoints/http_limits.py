"""Bounds on what one connection can hold, whatever uvicorn's HTTP parser: the request line and headers in bytes (431)
and in time (408), and the number of open connections (503 at accept, before a byte is read).

httptools, uvicorn's parser when installed, buffers a header without limit and waits for it forever, and uvicorn
arms no timer before a connection's first request; h11 bounds the size only. Both are subclassed here with the same
guard, so `uvicorn.Config(app, **uvicorn_config_kwargs(limits))` bounds either. uvicorn's `limit_concurrency` is not
used: it counts running requests as well as connections (a long stream would refuse others, which the engine's
queue bound does better) and it refuses only once a request's headers are in, so idle sockets still pile up.

The head's clock starts when the connection opens (one that never sends is closed silently, like an idle
keep-alive one) and, for later requests, at their first byte: idle time between requests is --timeout-keep-alive's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http
import json
import logging
import resource
from dataclasses import dataclass, field
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # uvicorn without its [standard] extra: h11 only
    HttpToolsProtocol = None

logger = logging.getLogger("pagedllm.entrypoints.http_limits")

DEFAULT_MAX_HEADER_BYTES = 16 * 1024  # h11's max_incomplete_event_size: request line + headers
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds from a request's first byte (a connection's opening) to its last header
MAX_CONNECTIONS_CEILING = 4096  # x 16 KiB of headers at most = 64 MiB, far more clients than a CPU engine serves
LINGER_SECONDS = 1.0  # a refused client gets this long to read the answer before the socket closes
MAX_LINGERING = 256  # refused sockets kept lingering at once; past this they close at once (fds stay bounded)
LOG_EVERY = 10.0  # seconds between two warnings about refused connections


def default_max_connections() -> int:
    """Half the process's file-descriptor limit (RLIMIT_NOFILE), at most MAX_CONNECTIONS_CEILING: the other half
    stays for model files, threads, Ray and the sockets refused while they linger."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 2 * MAX_CONNECTIONS_CEILING
    return max(16, min(MAX_CONNECTIONS_CEILING, soft // 2))


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may hold (`pagedllm serve --max-header-bytes/--header-timeout/--max-connections`)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_connections: int = field(default_factory=default_max_connections)

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "header_timeout", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The flags, in their own group of the command's help."""
        group = parser.add_argument_group("connections")
        group.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                           help="a request line and headers larger than this get 431")
        group.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                           help="seconds from a request's first byte to its last header (408 beyond)")
        group.add_argument("--max-connections", type=int, default=None,
                           help="open connections at most; more get 503 at once "
                                f"(default: half the fd limit, at most {MAX_CONNECTIONS_CEILING})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ConnectionLimits:
        cap = {} if args.max_connections is None else {"max_connections": args.max_connections}
        return cls(max_header_bytes=args.max_header_bytes, header_timeout=args.header_timeout, **cap)


def uvicorn_config_kwargs(limits: ConnectionLimits, parser: str = "auto") -> dict[str, Any]:
    """What to pass to uvicorn.Config for these limits; `parser` is uvicorn's `http` ("auto": httptools when
    installed, else h11)."""
    use_httptools = parser == "httptools" or (parser == "auto" and HttpToolsProtocol is not None)
    protocol = GuardedHttpToolsProtocol if use_httptools else GuardedH11Protocol
    return {"http": functools.partial(protocol, limits=limits),
            "h11_max_incomplete_event_size": limits.max_header_bytes}


def error_response(status: int, message: str, default_headers: list[tuple[bytes, bytes]],
                   extra: tuple[bytes, ...] = ()) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, with an OpenAI-style error body like the API's own."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    lines = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode()),
             *(name + b": " + value for name, value in default_headers), *extra,
             b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class ConnectionGuard:
    """The limits, over uvicorn's protocol (mixed in before it). A request's head is open from its first byte
    until the parser has its last header; the subclasses follow the parser to say when (`_in_head`, `_head_next`).
    What every request pays is a few attribute tests and one clock read."""

    lingering: ClassVar[int] = 0  # refused sockets waiting for their client to read the answer (process-wide)
    refusals: ClassVar[dict[int, int]] = {}  # status -> count since the last warning
    last_warning: ClassVar[float] = float("-inf")

    def __init__(self, *args: Any, limits: ConnectionLimits | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits or ConnectionLimits()
        self._in_head = False
        self._head_next = False  # the previous request is read whole: the next byte opens a head
        self._head_bytes = 0
        self._head_tail = b""  # the head's last two bytes so far: its end may straddle two reads
        self._head_deadline = 0.0
        self._head_timer: asyncio.TimerHandle | None = None  # one per connection, re-armed rather than replaced
        self._refused = False
        self._linger: asyncio.TimerHandle | None = None

    # ---- uvicorn's protocol interface ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if full:
            self.connections.discard(self)
            self._refuse(503, f"the server has {self.limits.max_connections} open connections, its limit "
                              "(--max-connections): retry later", b"retry-after: 1")
            return
        self._begin_head()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # a refused client's leftovers, read only so that the answer reaches it before the close
        if not self._in_head and self._head_next:
            self._begin_head()
        if self._in_head:
            if self._head_bytes + len(data) > self.limits.max_header_bytes and not self._head_ends_within(data):
                self._refuse_large_head()
                return
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse_large_head()
            else:
                self._head_tail = data[-2:]

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._head_timer = None
        if self._linger is not None:
            self._linger = None
            ConnectionGuard.lingering -= 1
        super().connection_lost(exc)

    # ---- the head: its size and its time ---------------------------------------------------------------------------
    def _begin_head(self) -> None:
        self._in_head = True
        self._head_next = False
        self._head_bytes = 0
        self._head_tail = b""
        self._head_deadline = self.loop.time() + self.limits.header_timeout
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._check_head_time)

    def _head_ends_within(self, data: bytes) -> bool:
        """Whether the head ends (an empty line) in the part of `data` the limit leaves room for, the rest being
        body: scanned only when `data` would cross the limit."""
        room = self.limits.max_header_bytes - self._head_bytes
        window = self._head_tail + data[:max(room, 0)]
        return b"\n\r\n" in window or b"\n\n" in window

    def _check_head_time(self) -> None:
        self._head_timer = None
        if not self._in_head or self._refused or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.cycle is not None and not self.cycle.response_complete:
            self._head_deadline = now + self.limits.header_timeout  # a pipelined head: its clock starts after
        if now < self._head_deadline:
            self._head_timer = self.loop.call_later(self._head_deadline - now, self._check_head_time)
        elif self._head_bytes == 0 and self.cycle is None:
            self.transport.close()  # opened and never used: closed as an idle keep-alive connection would be
        else:
            self._refuse(408, f"the request headers did not arrive within {self.limits.header_timeout:g} s "
                              "(--header-timeout)")

    def _refuse_large_head(self) -> None:
        self._refuse(431, f"the request line and headers are larger than {self.limits.max_header_bytes} bytes "
                          "(--max-header-bytes)")

    # ---- refusing: answer, then close ------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str, *extra: bytes) -> None:
        """Answer `status` and close. The close waits (LINGER_SECONDS at most) for the client to take the answer:
        closing with its request unread would reset the connection and lose the answer on the way."""
        self._refused = True
        self._in_head = False
        self._note(status)
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is under way: an answer now would garble it
            return
        self.transport.write(error_response(status, message, self.server_state.default_headers, extra))
        if not self.transport.can_write_eof() or ConnectionGuard.lingering >= MAX_LINGERING:
            self.transport.close()
            return
        self.transport.write_eof()
        ConnectionGuard.lingering += 1
        self._linger = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def _note(self, status: int) -> None:
        """A warning per LOG_EVERY seconds at most, with the counts: a flood must not flood the log too."""
        counts = ConnectionGuard.refusals
        counts[status] = counts.get(status, 0) + 1
        now = self.loop.time()
        if now - ConnectionGuard.last_warning >= LOG_EVERY:
            logger.warning("refused connections: %s", ", ".join(f"{n} x {s}" for s, n in sorted(counts.items())))
            counts.clear()
            ConnectionGuard.last_warning = now


class GuardedH11Protocol(ConnectionGuard, H11Protocol):
    """h11 with the guard: h11 itself also stops buffering a head at max_incomplete_event_size."""

    def handle_events(self) -> None:
        super().handle_events()
        idle = self.conn.their_state is h11.IDLE  # h11 waits for a request line
        if idle and not self._in_head and not self._head_next:  # a request just ended: is the next one begun?
            buffered = len(self.conn.trailing_data[0])  # a pipelined head, read while the last was answered
            if buffered:
                self._begin_head()
                self._head_bytes = buffered
        self._in_head = self._in_head and idle
        self._head_next = idle and not self._in_head


if HttpToolsProtocol is not None:
    class GuardedHttpToolsProtocol(ConnectionGuard, HttpToolsProtocol):
        """httptools with the guard; its parser calls these hooks as it reads (several requests in one read when
        a client pipelines)."""

        def on_message_begin(self) -> None:
            if not self._in_head:  # a pipelined request, begun in the read that ended the previous one
                self._begin_head()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._head_next = True
            super().on_message_complete()
else:  # pragma: no cover
    GuardedHttpToolsProtocol = GuardedH11Protocol
