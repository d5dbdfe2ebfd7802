"""Limits that keep one client from holding the server: the time to receive a request body (an ASGI middleware;
its size is FastAPI's `max_body_size`), the time a stream may wait for its client to read, and a small thread pool
for the work that grows with a request (tokenizing and rendering long prompts), off the event loop.

uvicorn holds a connection's headers to 16 KiB (h11's limit) and closes idle keep-alive connections after
--timeout-keep-alive; a client that sends its headers slowly holds one socket and no engine resource.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("pagedllm.entrypoints.openai.limits")
T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 2 << 20  # JSON parsing runs on the event loop: ~0.1-0.25 s per MiB at worst
DEFAULT_BODY_TIMEOUT = 30.0  # seconds to receive a whole body
DEFAULT_STREAM_SEND_TIMEOUT = 30.0  # seconds a stream waits for its client to take the next chunk
OFF_LOOP_CHARS = 8192  # longer prompts are tokenized (and chats rendered) in the worker threads
OFF_LOOP_TOKENS = 8192


class BodyTimeout(HTTPException):
    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout:g} s")


class BodyTimeoutMiddleware:
    """408 when a request's whole body takes longer than `timeout` seconds to arrive (a client that sends it byte by
    byte); FastAPI re-raises the HTTPException as it is. The size limit is FastAPI's own (`max_body_size`: 413)."""

    def __init__(self, app: ASGIApp, timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, self._timed(receive), send)

    def _timed(self, receive: Receive) -> Receive:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        done = False

        async def timed_receive() -> Message:
            nonlocal done
            if done:  # the body is in: later receives wait for a disconnect, without a deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyTimeout(self.timeout) from None
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return timed_receive


class ClientTooSlow(Exception):
    """A stream's client did not take a chunk within the send timeout."""


def timed_send(send: Send, timeout: float) -> Send:
    """`send` that gives up after `timeout` seconds (a client that stopped reading fills the socket, then blocks us)."""

    async def send_with_timeout(message: Message) -> None:
        try:
            await asyncio.wait_for(send(message), timeout)
        except asyncio.TimeoutError:
            raise ClientTooSlow(f"the client read nothing for {timeout:g} s") from None

    return send_with_timeout


class WorkerPool:
    """A few threads for request work that grows with the request (tokenizers release the GIL on long texts), so
    the event loop keeps answering; bounded, so big requests queue instead of crowding the engine's cores."""

    def __init__(self, workers: int = 2) -> None:
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="pagedllm-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
