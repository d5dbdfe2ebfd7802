"""The engine for a server: one background thread owns the LLMEngine and steps it; asyncio callers get
streams.

The engine is not thread-safe, so nothing but the loop thread touches it: requests and aborts reach it through
a queue it drains before every step, and outputs go back to each request's asyncio.Queue through
`loop.call_soon_threadsafe`. Every waiting and running request is in the same engine, so the scheduler batches
them all. When there is nothing to do the thread sleeps on an event (no busy spin).

A request a step fails on fails alone (LLMEngine isolates it); an error that escapes `step()` means the engine cannot
go on: the loop thread fails every request in flight with EngineRestartingError (a 503: retry), builds a fresh engine
with `engine_factory` and carries on. Without a factory the loop stops for good (EngineDeadError).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pagedllm.config import ServerConfig
from pagedllm.engine.protocol import (
    EngineClient,
    EngineDeadError,
    EngineRestartingError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    ServingObserver,
    SteppedEngine,
)
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

__all__ = ["AsyncLLMEngine", "AsyncRequestStream", "EngineDeadError", "EngineRestartingError", "QueueFullError",
           "RequestFailedError", "build_off_main_thread", "build_serving_engine"]

logger = logging.getLogger("pagedllm.engine.async_engine")

RESTART_ATTEMPTS = 3  # engine factory calls before the loop gives up

T = TypeVar("T")


def build_off_main_thread(factory: Callable[[], T]) -> T:
    """`factory()` run in a thread that ends when it returns: build an engine here that another thread will step.

    libgomp (torch's OpenMP) lets idle workers spin, ready for the next parallel region, only while it manages no
    more threads than there are CPUs, counting the workers of every thread that ever ran a parallel region until
    that thread ends. Loading and packing a model runs parallel regions, so an engine built by the main thread
    left a second pool beside the loop thread's, and each of a step's hundreds of regions then woke a sleeping
    worker: 19-25% of the throughput with 64 streams in flight (docs/scripts/engine_thread_pools.py). A thread's
    pool ends with it."""
    result: list[T] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            result.append(factory())
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=build, name="pagedllm-build")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def build_serving_engine(config: EngineConfig) -> LLMEngine:
    """An LLMEngine for a server, built off the main thread, its KV pool mapped before the first request.

    Blocks are handed out in the pool's order and freed ones queue behind it (the prefix cache keeps them longest),
    so a server's traffic walks the whole pool within minutes; each page's first touch (~2 s per GiB on this
    project's VMs) then came out of the model's two cores (a fresh server ran 4-6% slower, docs/performance-log.md).
    vLLM and llama.cpp zero their caches at start-up for the same effect."""
    from pagedllm.engine.llm_engine import LLMEngine

    engine = build_off_main_thread(lambda: LLMEngine(config))
    start = time.perf_counter()
    engine.wait_for_kv_cache()
    logger.info("KV cache mapped in %.1f s", time.perf_counter() - start)
    return engine


class AsyncRequestStream(RequestStream):
    """The outputs of one request, as an async iterator; cancelling it (or the task reading it) aborts it.

    Outputs are cumulative (each holds all tokens and text so far), so the stream keeps only the newest: a reader
    slower than the engine gets several tokens at once, and an unread stream holds one output, not one per token
    (as vLLM's RequestOutputCollector)."""

    def __init__(self, request_id: str, owner: AsyncLLMEngine, num_seqs: int = 1) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs  # its n: what it counts for admission until its first output
        self.started = False  # an output arrived: the scheduler took the request
        self.finished = False
        self._owner = owner
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Replace the unread output; a final output or an error is never replaced."""
        latest = self._latest
        if isinstance(latest, BaseException) or (latest is not None and latest.finished):
            return
        self._latest = item
        self._ready.set()

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except asyncio.CancelledError:
            self.cancel()
            raise
        item, self._latest = self._latest, None
        self._ready.clear()
        assert item is not None
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


class AsyncLLMEngine(EngineClient):
    """Runs `engine.step()` in one thread; `add_request` (from the event loop) returns a stream of its outputs."""

    def __init__(self, engine: SteppedEngine, max_waiting_requests: int = ServerConfig.max_waiting_requests,
                 observer: ServingObserver | None = None,
                 engine_factory: Callable[[], SteppedEngine] | None = None) -> None:
        self.engine: SteppedEngine | None = engine  # None only while a restart builds the next one
        self.engine_factory = engine_factory
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self.dead_error: BaseException | None = None
        self.restarting = False
        self.num_restarts = 0
        self.restart_reason: str | None = None
        # facts that a restart does not change, read from the event loop
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self.max_prompt_chars: int | None = engine.max_prompt_chars
        self.num_running = 0  # published by the loop thread after every step, read by the event loop
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, AsyncRequestStream] = {}  # event-loop side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

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

    # ---- the engine's read-only facts (safe from the event loop or a worker thread: they never change) ------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """The engine's checked tokenization; reads nothing the loop thread changes."""
        engine = self.engine
        if engine is None:
            raise EngineRestartingError(self._restarting_message())
        return engine.tokenize_prompt(prompt)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output grammar into the engine's cache in a worker thread (the compiler is thread-safe
        and drops the GIL), so neither the event loop nor the loop thread waits for a big schema."""
        await asyncio.to_thread(self.engine.compile_grammar, spec)

    def replica_health(self) -> None:
        """One engine: /health's status code says it all."""
        return None

    @property
    def is_alive(self) -> bool:
        """Serving now: not dead, not restarting (/health's answer)."""
        return self.dead_error is None and not self.restarting and self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running yet (queued here or in the scheduler)."""
        return max(0, len(self._streams) - self.num_running)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences of the requests in flight that have no output yet (queued here or in the scheduler)."""
        return sum(s.num_seqs for s in self._streams.values() if not s.started)

    def check_alive(self) -> None:
        if self.restarting and self.dead_error is None:
            raise EngineRestartingError(self._restarting_message())
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")

    def _restarting_message(self) -> str:
        return f"the engine failed ({self.restart_reason}) and is restarting; retry the request"

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read the adapter's files in a worker thread, then register it on the loop thread between steps."""
        self.check_alive()
        adapter = await asyncio.to_thread(self.engine.read_lora, lora_request)
        await self._call(self.engine.add_read_lora, lora_request, adapter)

    async def remove_lora(self, lora_int_id: int) -> bool:
        self.check_alive()
        return await self._call(self.engine.remove_lora, lora_int_id)

    def _call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run `fn(*args)` on the loop thread between steps; its result (or error) on the returned future."""
        future = asyncio.get_running_loop().create_future()
        self._send(("call", fn, args, future))
        return future

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    lora_request: LoRARequest | None = None, arrival_time: float | None = None,
                    ) -> AsyncRequestStream:
        """Queue a request for the loop thread; its outputs (or its error) arrive on the returned stream.
        Admission (the waiting-queue bound) is the caller's `check_admission(num_seqs)`, once per request group."""
        self.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = AsyncRequestStream(request_id, self, params.n)
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, arrival_time or time.time(), lora_request))
        return stream

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
            stream.started = True
            stream.put(item)
            if isinstance(item, BaseException) or item.finished:  # no longer in flight, even if unread
                self._forget(request_id)

    def _fail_all(self, error: BaseException) -> None:
        """Every request in flight ends with `error`; their ids are aborted too, in case an add is still queued."""
        for request_id, stream in list(self._streams.items()):
            stream.put(error)
            self.abort(request_id)
        self._streams.clear()

    # ---- loop thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._wake.clear()  # before draining, so a command sent after the drain wakes the wait below
                drained = self._drain()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    if drained:
                        self._observe([])
                    self._wake.wait()
            except Exception as e:  # the engine cannot go on: replace it, or stop (/health turns 503)
                if not self._restart(e):
                    return

    def _restart(self, error: Exception) -> bool:
        """Fail the requests in flight with a 503 that says to retry, drop the broken engine, build a fresh one;
        False when there is no factory or it keeps failing (then the loop stops for good)."""
        reason = f"{type(error).__name__}: {error}"
        if self.engine_factory is None:
            logger.error("the engine failed and cannot recover (%s); no engine factory, so it stays down", reason,
                         exc_info=error)
            self.dead_error = error
            self._post(self._fail_all, EngineDeadError(f"the engine loop has stopped: {error!r}"))
            return False
        logger.error("the engine failed and cannot recover (%s); restarting it", reason, exc_info=error)
        self.restart_reason, self.restarting = reason, True
        self._post(self._fail_all, EngineRestartingError(self._restarting_message()))
        self.engine = None  # the old engine's KV cache goes before the new one takes its own
        gc.collect()
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            try:
                self.engine = self.engine_factory()
                break
            except Exception as e:
                logger.exception("engine restart %d/%d failed", attempt, RESTART_ATTEMPTS)
                self.dead_error = e
                time.sleep(attempt)
        else:
            self._post(self._fail_all, EngineDeadError(f"the engine could not be restarted: {self.dead_error!r}"))
            return False
        self.dead_error = None
        self.num_restarts += 1
        if self.observer is not None:
            self.observer.record_restart()
        self.restarting = False
        logger.warning("engine restarted (%d restart(s) since the server started)", self.num_restarts)
        return True

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
                _, request_id, prompt, params, arrival, lora_request = command
                try:
                    lora = {"lora_request": lora_request} if lora_request is not None else {}
                    self.engine.add_request(request_id, prompt, params, arrival_time=arrival, **lora)
                except Exception as e:  # validation: this request only
                    results.append((request_id, e))
            elif command[0] == "call":
                self._run_call(*command[1:])
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

    def _run_call(self, fn: Callable[..., Any], args: tuple, future: asyncio.Future) -> None:
        try:
            result = fn(*args)
        except Exception as e:  # the caller's error (a 400), never the engine's
            self._post(settle, future, None, e)
        else:
            self._post(settle, future, result, None)

    def _step(self) -> None:
        """One engine step; a request it failed on gets its error instead of its last output."""
        outputs = self.engine.step()
        failed = self.engine.pop_failed_requests()
        self.num_running = self.engine.num_running
        self._observe(outputs)
        if outputs:
            self._post(self._deliver, [(out.request_id, self._failure(failed[out.request_id])
                                        if out.request_id in failed else out) for out in outputs])

    @staticmethod
    def _failure(error: BaseException) -> RequestFailedError:
        return RequestFailedError(f"the engine failed on this request: {error}")

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


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Give an event-loop future its result or error (unless its awaiter went away)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
