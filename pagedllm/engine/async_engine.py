"""The engine for a server: one background thread owns the LLMEngine and steps it; asyncio callers get
streams.

The engine is not thread-safe, so nothing but the loop thread touches it: requests and aborts reach it through
a queue it drains before every step, and outputs go back to each request's asyncio.Queue through
`loop.call_soon_threadsafe`. Every waiting and running request is in the same engine, so the scheduler batches
them all. When there is nothing to do the thread sleeps on an event (no busy spin).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedllm.engine.async_engine")

MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: no request can be served any more."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""


class StepObserver(Protocol):
    """Gets every batch of outputs from the loop thread (metrics and logging, see metrics.EngineStats)."""

    def record(self, engine: Any, outputs: list[RequestOutput]) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator; cancelling it (or the task reading it) aborts it."""

    def __init__(self, request_id: str, owner: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._done()
            raise item
        if item.finished:
            self._done()
        return item

    def cancel(self) -> None:
        """Abort the request if it is still running (a no-op once it finished)."""
        if not self.finished:
            self._done()
            self._owner.abort(self.request_id)

    def _done(self) -> None:
        self.finished = True
        self._owner._forget(self.request_id)


class AsyncLLMEngine:
    """Runs `engine.step()` in one thread; `add_request` (from the event loop) returns a RequestStream."""

    def __init__(self, engine: Any, max_waiting_requests: int = 256,
                 observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self.dead_error: BaseException | None = None
        self.num_running = 0  # published by the loop thread after every step, read by the event loop
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._step_failures = 0

    # ---- event-loop side --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the engine's read-only facts (safe from the event loop: they never change) -------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """The engine's checked tokenization; reads nothing the loop thread changes."""
        return self.engine.tokenize_prompt(prompt)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output grammar into the engine's cache in a worker thread (the compiler is thread-safe
        and drops the GIL), so neither the event loop nor the loop thread waits for a big schema."""
        await asyncio.to_thread(self.engine.compile_grammar, spec)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running yet (queued here or in the scheduler)."""
        return max(0, len(self._streams) - self.num_running)

    def check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")

    def check_admission(self) -> None:
        """Raise before anything is queued if the engine is dead or the waiting queue is full."""
        self.check_alive()
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting; retry later")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> RequestStream:
        """Queue a request for the loop thread; its outputs (or its error) arrive on the returned stream.
        Admission (the waiting-queue bound) is the caller's `check_admission()`, once per request group."""
        self.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, arrival_time or time.time()))
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       ) -> AsyncIterator[RequestOutput]:
        """vLLM's shape: an async generator of outputs; closing it early aborts the request."""
        self.check_admission()
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.cancel()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the loop frees the request's blocks before its next step."""
        self._send(("abort", request_id))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # cancelled meanwhile
            stream.put(item)
            if isinstance(item, BaseException) or item.finished:  # no longer in flight, even if unread
                self._forget(request_id)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(f"the engine loop has stopped: {error!r}"))
        self._streams.clear()

    # ---- loop thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()  # before draining, so a command sent after the drain wakes the wait below
                drained = self._drain()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    if drained:
                        self._observe([])
                    self._wake.wait()
        except BaseException as e:  # the loop itself failed: fail everyone, /health turns 503
            logger.exception("engine loop died")
            self.dead_error = e
            self._post(self._fail_all, e)

    def _drain(self) -> bool:
        """Apply every queued add and abort; a bad request fails alone."""
        results: list[tuple[str, RequestOutput | BaseException]] = []
        aborted: list[RequestOutput] = []
        drained = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            drained = True
            if command[0] == "add":
                _, request_id, prompt, params, arrival = command
                try:
                    self.engine.add_request(request_id, prompt, params, arrival_time=arrival)
                except Exception as e:  # validation: this request only
                    results.append((request_id, e))
            else:
                out = self.engine.abort_request(command[1])
                if out is not None:
                    aborted.append(out)
        self.num_running = self.engine.num_running
        if aborted:
            self._observe(aborted)
        if results:
            self._post(self._deliver, results)
        return drained

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._fail_step(e)
            return
        self._step_failures = 0
        self.num_running = self.engine.num_running
        self._observe(outputs)
        if outputs:
            self._post(self._deliver, [(out.request_id, out) for out in outputs])

    def _fail_step(self, error: Exception) -> None:
        """A failed step fails the requests that ran in it, not the engine (unless the engine is broken)."""
        aborted = self.engine.fail_running()
        victims = [out.request_id for out in aborted]
        logger.exception("engine step failed; failing its %d running requests", len(victims))
        self.num_running = self.engine.num_running
        self._observe(aborted)
        self._step_failures += 1
        self.engine.check_invariants()  # raises if the failure left the block pool inconsistent: loop dies
        if self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(f"{self._step_failures} engine steps failed in a row") from error
        failure = RuntimeError(f"the engine failed on this request: {error}")
        self._post(self._deliver, [(r, failure) for r in victims])

    def _observe(self, outputs: list[RequestOutput]) -> None:
        if self.observer is None:
            return
        try:
            self.observer.record(self.engine, outputs)
        except Exception:  # metrics must never take the engine down
            logger.exception("metrics observer failed")

    def _post(self, fn: Any, *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)
