"""Limits that keep one client from holding the server: the size of a request body and the time to receive it (an
ASGI middleware, before FastAPI parses anything), the time a stream may wait for its client to read (every stream:
completions, chats and the dashboard's), and small thread pools for the work that grows with a request (tokenizing
and rendering long prompts) off the event loop: one for the generating routes, one with a bounded queue for the
utility routes (/tokenize, /detokenize) that are open without --api-key, so a flood of those cannot delay the others.

What a connection may hold before a request exists (its headers' size and time, the number of connections) is
bounded below the app, in uvicorn's protocol (entrypoints/http_limits.py); idle keep-alive connections close after
--timeout-keep-alive.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai.errors import APIError

logger = logging.getLogger("pagedllm.entrypoints.openai.limits")
T = TypeVar("T")

OFF_LOOP_CHARS = 8192  # longer prompts are tokenized (and chats rendered) in the worker threads
OFF_LOOP_TOKENS = 8192
UTILITY_WORKERS = 1  # threads for the open utility routes' tokenizer work: at most one core's worth
UTILITY_PENDING = 8  # their jobs running or queued at once; past this, 503 at once


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes (--max-request-bytes)")


class BodyTimeout(HTTPException):
    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout:g} s")


class RequestLimitMiddleware:
    """413 for a body over `max_bytes` (by its Content-Length before a byte is read, else by counting what arrives),
    408 when the whole body takes longer than `timeout` seconds to arrive (a client sending it byte by byte). FastAPI
    re-raises these HTTPExceptions as they are, so the client gets OpenAI's error body (FastAPI's own max_body_size
    answers a declared oversize body in plain text)."""

    def __init__(self, app: ASGIApp, max_bytes: int = ServerConfig.max_request_bytes,
                 timeout: float = ServerConfig.body_timeout) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0").strip()
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.app(scope, self._refuse, send)  # the route's first receive raises: nothing is read
            return
        await self.app(scope, self._limited(receive), send)

    async def _refuse(self) -> Message:
        raise BodyTooLarge(self.max_bytes)

    def _limited(self, receive: Receive) -> Receive:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        received = 0
        done = False

        async def limited_receive() -> Message:
            nonlocal received, done
            if done:  # the body is in: later receives wait for a disconnect, without a deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyTimeout(self.timeout) from None
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return limited_receive


class SendDeadline:
    """`send` for a stream, and a timer that cancels the stream's task once one send has waited `timeout` seconds (a
    client that stopped reading fills the socket, then blocks us). One timer per stream that re-arms itself rather
    than asyncio.wait_for around each chunk, which cost a task, a timer and a waiter per streamed token."""

    def __init__(self, send: Send, timeout: float) -> None:
        self._send = send
        self.timeout = timeout
        self.expired = False
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._since: float | None = None  # when the send in progress began
        self._timer = self._loop.call_later(timeout, self._check)

    async def send(self, message: Message) -> None:
        self._since = self._loop.time()
        try:
            await self._send(message)
        finally:
            self._since = None

    def _check(self) -> None:
        now, since = self._loop.time(), self._since
        if since is not None and now - since >= self.timeout:
            self.expired = True
            if self._task is not None:
                self._task.cancel()
            return
        self._timer = self._loop.call_later(self.timeout if since is None else since + self.timeout - now, self._check)

    def close(self) -> None:
        self._timer.cancel()


class DeadlineStreamingResponse(StreamingResponse):
    """A stream dropped once its client stops reading: when one send has waited `send_timeout` seconds (the socket
    full), the response's task is cancelled; `closed()` runs however the stream ended."""

    def __init__(self, content: AsyncIterable[str], send_timeout: float = ServerConfig.stream_send_timeout,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deadline = SendDeadline(send, self.send_timeout)
        try:
            await super().__call__(scope, receive, deadline.send)
        except asyncio.CancelledError:
            if not deadline.expired:
                raise
            asyncio.current_task().uncancel()  # our own timer's cancellation, handled here
            logger.warning("dropping a stream of %s: the client read nothing for %g s", scope.get("path"),
                           self.send_timeout)
        finally:
            deadline.close()
            self.closed()

    def closed(self) -> None:
        """Release what the stream held (its requests, its subscription)."""


class WorkerPool:
    """A few threads for request work that grows with the request (tokenizers release the GIL on long texts), so
    the event loop keeps answering; bounded, so big requests queue instead of crowding the engine's cores. With
    `max_pending`, at most that many jobs run or wait at once, and the next is a 503 rather than a longer queue."""

    def __init__(self, workers: int = 2, max_pending: int | None = None, name: str = "pagedllm-tokenize") -> None:
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self.max_pending = max_pending
        self.slots = None if max_pending is None else threading.BoundedSemaphore(max_pending)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.slots is None:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        if not self.slots.acquire(blocking=False):
            raise APIError(503, f"{self.max_pending} tokenizer jobs of the utility routes are already queued; retry "
                           "later", "server_error", code="server_overloaded", headers={"Retry-After": "1"})
        try:
            future = self.executor.submit(fn, *args)
        except BaseException:
            self.slots.release()
            raise
        future.add_done_callback(lambda _: self.slots.release())  # when the job ends, even if its caller left
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def utility_pool() -> WorkerPool:
    """The open utility routes' pool: UTILITY_WORKERS threads, UTILITY_PENDING jobs at once."""
    return WorkerPool(UTILITY_WORKERS, UTILITY_PENDING, "pagedllm-utility")
