"""One engine replica as a Ray actor: an AsyncLLMEngine in its own process, with its own threads, KV pool and prefix
cache, reached by `ReplicaPool` (replica_pool.py).

Requests come in one call each (`add`); outputs go out on one long-lived stream per replica (`outputs`), a batch per
engine step holding the latest output of every request that moved, rather than one Ray object per token per
request: the per-object cost of Ray would otherwise come out of the replica's own cores. For the same reason the
dashboard's KV snapshots, taken on the engine thread at most `kv_snapshot_rate` a second, ride on that stream too
(a Ray call per snapshot cost the replica ~9 ms of CPU: 8% of a tiny model's throughput at 4 a second). This module
does not import ray; the pool wraps the class with `ray.remote`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, build_serving_engine
from pagedllm.engine.protocol import RequestStream, ServingObserver, SteppedEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.core.kv_view import KVSnapshot

Item = RequestOutput | BaseException
KV_SNAPSHOT = "\0kv-snapshot"  # in an `outputs` batch, in the place of a request id: a KV snapshot (no id has a NUL)


@dataclass
class ReplicaInfo:
    """What the pool needs to know of a replica once it is up (the same for every replica of one config)."""

    boot_id: str  # new at every (re)start: a changed id means the replica lost its prefix cache
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int


@dataclass
class ReplicaStatus:
    """A health check's answer: liveness, queue lengths and the replica's Prometheus text."""

    boot_id: str
    alive: bool
    num_running: int
    num_waiting: int
    metrics_text: str | None


class SnapshotTaker(ServingObserver):
    """The replica's engine observer: passes every step on to the server's observer (its metrics) and, for the
    dashboard, takes a KV snapshot on the engine thread (the engine is not thread-safe) at most `rate` a second
    while the engine works and once when it goes idle: a diff since the last, or a full one when one was asked for.
    `deliver` gets each on the actor's event loop."""

    def __init__(self, inner: ServingObserver | None, rate: float | None,
                 deliver: Callable[[KVSnapshot], None]) -> None:
        self.inner, self.period, self.deliver = inner, 1.0 / rate if rate else None, deliver
        self.loop: asyncio.AbstractEventLoop | None = None
        self.version: int | None = None
        self.last_taken = 0.0
        self.fulls_asked = self.fulls_taken = 0  # asked on the event loop, taken on the engine thread

    def ask_full(self) -> None:
        self.fulls_asked += 1

    def record(self, engine: SteppedEngine, outputs: list[RequestOutput]) -> None:
        if self.inner is not None:
            self.inner.record(engine, outputs)
        if self.period is None or self.loop is None or self.loop.is_closed():
            return
        now, asked = time.monotonic(), self.fulls_asked
        busy = engine.num_running or engine.num_waiting
        if asked == self.fulls_taken and busy and now - self.last_taken < self.period:
            return
        snap = engine.kv_snapshot(None if asked != self.fulls_taken else self.version)
        self.version, self.last_taken, self.fulls_taken = snap.version, now, asked
        self.loop.call_soon_threadsafe(self.deliver, snap)

    def record_restart(self) -> None:
        if self.inner is not None:
            self.inner.record_restart()


class EngineReplica:
    """The actor's class: builds the engine in the replica's process; every method runs on the actor's event loop,
    the engine steps in the AsyncLLMEngine's thread."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int = ServerConfig.max_waiting_requests,
                 observer_factory: Callable[[], ServingObserver] | None = None,
                 kv_snapshot_rate: float | None = None) -> None:
        llm = build_serving_engine(config)
        self.observer = observer_factory() if observer_factory else None
        self.snapshots = SnapshotTaker(self.observer, kv_snapshot_rate, self._put_snapshot)
        self.engine = AsyncLLMEngine(llm, max_waiting_requests, observer=self.snapshots)
        self.wake_id = f"kv-snapshot-{uuid.uuid4().hex}"  # aborting an id no request has wakes an idle engine
        self.kv_ready: list[KVSnapshot] = []  # snapshots not sent yet, in order
        self.info_ = ReplicaInfo(uuid.uuid4().hex, llm.model_name, llm.max_model_len, llm.model_config.vocab_size,
                                 config.block_size, llm.stats().num_total_blocks)
        self.streams: dict[str, RequestStream] = {}
        self.pumps: dict[str, asyncio.Task] = {}
        self.ready: dict[str, Item] = {}  # the latest output (or error) of each request that moved, not sent yet
        self.moved: asyncio.Event | None = None

    def _start(self) -> None:
        """Start the engine thread on the actor's event loop (at the first call, also after a restart)."""
        if self.moved is None:
            self.moved = asyncio.Event()
            self.snapshots.loop = asyncio.get_running_loop()
            self.engine.start()

    async def info(self) -> ReplicaInfo:
        self._start()
        return self.info_

    async def status(self) -> ReplicaStatus:
        self._start()
        text = None
        registry = getattr(self.observer, "registry", None)
        if registry is not None:
            from prometheus_client import generate_latest

            text = generate_latest(registry).decode()
        return ReplicaStatus(self.info_.boot_id, self.engine.is_alive, self.engine.num_running,
                             self.engine.num_waiting, text)

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; its outputs, or its error (bad input, a full queue), come on the `outputs` stream."""
        self._start()
        try:
            self.engine.check_admission(params.n)
            stream = self.engine.add_request(request_id, prompt_token_ids, params)
        except Exception as e:
            self._put(request_id, e)
            return
        self.streams[request_id] = stream
        self.pumps[request_id] = asyncio.ensure_future(self._pump(request_id, stream))

    async def abort(self, request_id: str) -> None:
        pump = self.pumps.pop(request_id, None)
        if pump is not None:
            pump.cancel()
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()
        self.ready.pop(request_id, None)

    async def outputs(self) -> AsyncIterator[list[tuple[str, Item | KVSnapshot]]]:
        """Forever: each time requests moved, the latest output (or error) of each, in one batch, then the KV
        snapshots taken meanwhile (keyed KV_SNAPSHOT), the first of them a full one. To start the new reader with
        the whole pool, an idle engine is woken: an abort of an id no request has makes its thread drain its
        commands and call its observer."""
        self._start()
        assert self.moved is not None
        self.kv_ready.clear()
        self.snapshots.ask_full()
        self.engine.abort(self.wake_id)
        while True:
            await self.moved.wait()
            self.moved.clear()
            batch: list[tuple[str, Item | KVSnapshot]] = list(self.ready.items())
            batch += [(KV_SNAPSHOT, snap) for snap in self.kv_ready]
            self.ready, self.kv_ready = {}, []
            if batch:
                yield batch

    async def _pump(self, request_id: str, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._put(request_id, out)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._put(request_id, e)
        finally:
            self.pumps.pop(request_id, None)
            self.streams.pop(request_id, None)
            with contextlib.suppress(Exception):
                stream.cancel()

    def _put_snapshot(self, snap: KVSnapshot) -> None:
        self.kv_ready.append(snap)
        assert self.moved is not None
        self.moved.set()

    def _put(self, request_id: str, item: Item) -> None:
        if not isinstance(self.ready.get(request_id), BaseException):  # an error is the last word
            self.ready[request_id] = item
        assert self.moved is not None
        self.moved.set()

