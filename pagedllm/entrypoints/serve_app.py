"""pagedllm on Ray Serve, for users who already run it: `serve run pagedllm.entrypoints.serve_app:app_builder
model=PATH num_replicas=4 threads=2`, or `serve.run(pagedllm.serve_app(model=PATH, num_replicas=4))`.

An OpenAI-compatible ingress (the same FastAPI app as `pagedllm serve`) in front of an engine deployment whose
replicas each hold an AsyncLLMEngine. Ray Serve routes the ingress's calls to the engine replicas with
PrefixAffinityRequestRouter: the prefix-affinity policy of engine/router.py written against Ray Serve's custom
request router API (`ray.serve.request_router.RequestRouter`, alpha in Ray 2.60), with the same chained block hashes
and bounded LRU index, and Serve's own queue lengths as the load.

What Serve does here and `--data-parallel-size` does itself: placement, restarts and health checks are Serve's;
a request on a replica that dies fails (Serve does not move a request it has assigned), so ReplicaPool's
distinction between streamed and unstreamed requests is not made.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, build_serving_engine
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.engine.prompts import tokenize_prompt
from pagedllm.engine.protocol import EngineClient, RequestStream
from pagedllm.engine.router import DEFAULT_ROUTING_MARGIN, PrefixIndex, block_hashes
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


class PrefixAffinityRequestRouter(RequestRouter):
    """Ray Serve request router: the replica holding the longest prefix of the prompt's blocks first, unless its
    queue is `margin` requests longer than the shortest; then (or with no match) two random replicas."""

    def initialize_state(self, block_size: int = 16, margin: int = DEFAULT_ROUTING_MARGIN,
                         index_blocks: int = 1 << 16) -> None:
        self.block_size, self.margin = block_size, margin
        self.index = PrefixIndex(0, index_blocks)
        self.slots: dict[ReplicaID, int] = {}
        self.pending: dict[str, list[int]] = {}  # request id -> the prompt's hashes, until the request is routed
        self.affinity_hits = 0

    def slot(self, replica_id: ReplicaID) -> int:
        if replica_id not in self.slots:
            self.slots[replica_id] = self.index.add_replica()
        return self.slots[replica_id]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        fallback = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        ids = prompt_token_ids(pending_request)
        if not ids:
            return [fallback]
        hashes = block_hashes(ids, self.block_size)
        self.pending[pending_request.metadata.request_id] = hashes  # type: ignore[union-attr]
        by_slot = {self.slot(r.replica_id): r for r in candidate_replicas}
        best, matched = self.index.match(hashes, set(by_slot))
        if not matched:
            return [fallback]
        queue = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
        choice = min((by_slot[s] for s in best), key=lambda r: queue[r.replica_id])
        if queue[choice.replica_id] > min(queue.values()) + self.margin:
            return [fallback]
        self.affinity_hits += 1
        return [[choice], fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hashes = self.pending.pop(pending_request.metadata.request_id, None)
        if hashes:
            self.index.insert(self.slot(replica_id), hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if replica_id in self.slots:
            self.index.clear(self.slots[replica_id])


def prompt_token_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """EngineDeployment.generate(request_id, prompt_token_ids, params): the second argument."""
    if pending_request is None or len(pending_request.args) < 2 or not isinstance(pending_request.args[1], list):
        return None
    return pending_request.args[1]


class EngineDeployment:
    """One Serve replica: an engine with its own threads, KV pool and prefix cache."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int = ServerConfig.max_waiting_requests) -> None:
        self.llm = build_serving_engine(config)
        self.engine = AsyncLLMEngine(self.llm, max_waiting_requests)
        self.started = False

    def _start(self) -> None:
        if not self.started:
            self.engine.start()
            self.started = True

    async def info(self) -> dict[str, Any]:
        self._start()
        return {"model_name": self.llm.model_name, "max_model_len": self.llm.max_model_len,
                "vocab_size": self.llm.model_config.vocab_size}

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self._start()
        async for out in self.engine.generate(request_id, prompt_token_ids, params):
            yield out

    async def prefix_cache(self) -> dict[str, int]:
        """This replica's prefix cache counters (tokens), and its process id to tell replicas apart."""
        import os

        stats = self.llm.stats()
        return {"pid": os.getpid(), "queries": stats.prefix_cache_queries, "hits": stats.prefix_cache_hits}

    async def check_health(self) -> None:
        if self.started and not self.engine.is_alive:
            raise RuntimeError(f"the engine loop has stopped: {self.engine.dead_error!r}")


class ServeStream(RequestStream):
    """A request's outputs from the engine deployment, a RequestStream (engine/protocol.py)."""

    def __init__(self, response: Any, request_id: str) -> None:
        self.response, self.request_id, self.finished = response, request_id, False

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.response.__anext__()
        self.finished = out.finished
        return out

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self.response.cancel()

    def allow_restart(self) -> None:
        """Serve does not start a request over on another replica."""


class ServeEngineClient(EngineClient):
    """The engine client the OpenAI app expects, over a handle to the engine deployment (bound in the ingress
    replica, where the handle exists)."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self.bound: dict[str, Any] = {}  # the engine deployment's facts, once the ingress replica has its handle

    async def bind(self, handle: Any) -> None:
        info = await handle.info.remote()
        self.bound = {**info, "handle": handle.options(stream=True), "tokenizer": load_tokenizer(self.model)}

    @property
    def is_alive(self) -> bool:
        """Serve checks the replicas' health itself."""
        return True

    @property
    def tokenizer(self) -> Any:
        return self.bound["tokenizer"]

    @property
    def max_model_len(self) -> int:
        return self.bound["max_model_len"]

    @property
    def vocab_size(self) -> int:
        return self.bound["vocab_size"]

    @property
    def model_name(self) -> str:
        return self.bound["model_name"]

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.tokenizer.max_token_chars

    @property
    def num_waiting(self) -> int:
        """Serve keeps the queues; the ingress sees none."""
        return 0

    def check_alive(self) -> None:
        """Serve routes around replicas that fail their health checks."""

    def replica_health(self) -> None:
        """Serve reports its replicas itself (`serve status`)."""
        return None

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """The engine replica compiles the grammar when the request reaches it."""

    def start(self) -> None:
        """Serve starts and stops the replicas."""

    def shutdown(self) -> None:
        """Serve starts and stops the replicas."""

    @property
    def num_waiting_seqs(self) -> int:
        return 0

    def check_admission(self, num_seqs: int = 1) -> None:
        """Serve queues (max_ongoing_requests per replica) and applies back-pressure itself."""

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, self.vocab_size, self.max_model_len)

    def abort(self, request_id: str) -> None:
        """A request is cancelled through its stream (ServeStream.cancel)."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> ServeStream:
        ids = self.tokenize_prompt(prompt)
        return ServeStream(self.bound["handle"].generate.remote(request_id, ids, params), request_id)


def serve_app(model: str | None = None, num_replicas: int = 2, threads: int = 1, block_size: int = 16,
              routing_margin: int = DEFAULT_ROUTING_MARGIN, max_ongoing_requests: int = 64,
              served_model_name: str | None = None, **engine_args: Any) -> Any:
    """A Ray Serve application: the OpenAI-compatible ingress and `num_replicas` engine replicas of `threads`
    threads each, routed by prefix affinity. `engine_args` are EngineConfig fields (dtype, num_blocks, ...)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedllm.entrypoints.openai.app import build_client_app
    from pagedllm.entrypoints.openai.metrics import EngineStats

    config = EngineConfig(model=model, threads=threads, block_size=block_size, **engine_args)
    engine = serve.deployment(EngineDeployment, name="PagedLLMEngine").options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": threads},
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRequestRouter,
            request_router_kwargs={"block_size": block_size, "margin": routing_margin})).bind(config)
    name = served_model_name or model or "default"

    # The app is built in the ingress replica, after its constructor bound the client to the engine's handle: a
    # FastAPI app built here would be pickled with its thread pools and locks, which Serve refuses.
    @serve.deployment(name="PagedLLMIngress", ray_actor_options={"num_cpus": 0})
    @serve.ingress()
    class Ingress:
        async def __init__(self, handle: Any) -> None:  # Serve awaits an async constructor
            self.client = ServeEngineClient(model)
            await self.client.bind(handle)

        def __serve_build_asgi_app__(self) -> FastAPI:
            return build_client_app(self.client, EngineStats(name), [name], model_path=model)

    return Ingress.bind(engine)


def app_builder(args: dict[str, str]) -> Any:
    """`serve run pagedllm.entrypoints.serve_app:app_builder model=... num_replicas=2 threads=1`."""
    ints = {"num_replicas", "threads", "block_size", "routing_margin", "max_ongoing_requests", "num_blocks",
            "max_num_seqs", "max_num_batched_tokens", "max_model_len"}
    return serve_app(**{k: int(v) if k in ints else v for k, v in args.items()})

