"""One engine replica as a Ray actor: an AsyncLLMEngine in its own process, with its own threads, KV pool and prefix
cache, reached by `ReplicaPool` (replica_pool.py).

Requests come in one call each (`add`); outputs go out on one long-lived stream per replica (`outputs`), a batch per
engine step holding the latest output of every request that moved, rather than one Ray object per token per
request: the per-object cost of Ray would otherwise come out of the replica's own cores. This module does not
import ray; the pool wraps the class with `ray.remote`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, build_serving_engine
from pagedllm.engine.protocol import RequestStream, ServingObserver
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

Item = RequestOutput | BaseException


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


class EngineReplica:
    """The actor's class: builds the engine in the replica's process; every method runs on the actor's event loop,
    the engine steps in the AsyncLLMEngine's thread."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int = ServerConfig.max_waiting_requests,
                 observer_factory: Callable[[], ServingObserver] | None = None) -> None:
        llm = build_serving_engine(config)
        self.observer = observer_factory() if observer_factory else None
        self.engine = AsyncLLMEngine(llm, max_waiting_requests, observer=self.observer)
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

    async def outputs(self) -> AsyncIterator[list[tuple[str, Item]]]:
        """Forever: each time requests moved, the latest output (or error) of each, in one batch."""
        self._start()
        assert self.moved is not None
        while True:
            await self.moved.wait()
            self.moved.clear()
            batch, self.ready = list(self.ready.items()), {}
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

    def _put(self, request_id: str, item: Item) -> None:
        if not isinstance(self.ready.get(request_id), BaseException):  # an error is the last word
            self.ready[request_id] = item
        assert self.moved is not None
        self.moved.set()

