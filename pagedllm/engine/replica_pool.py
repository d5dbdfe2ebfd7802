"""Several engine replicas behind one engine client: Ray actors (replica.py), a router (router.py), health checks
and fault handling. The server talks to a ReplicaPool as it talks to one AsyncLLMEngine (both are an EngineClient,
protocol.py).

Faults: a replica whose actor dies is restarted by Ray (`max_restarts`); one whose engine loop died is killed so
that Ray restarts it. Its requests that had no output yet are routed again to another replica; those that had end
with ReplicaDiedError (a 503). The router skips a replica from the failure until a health check passes with the new
incarnation (whose prefix index starts empty). No request waits on a dead replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pagedllm
from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.cpus import cpu_budget
from pagedllm.engine.prompts import tokenize_prompt
from pagedllm.engine.protocol import EngineClient, EngineDeadError, RequestStream, ServingObserver
from pagedllm.engine.replica import KV_SNAPSHOT, EngineReplica, ReplicaInfo, ReplicaStatus
from pagedllm.engine.router import DEFAULT_ROUTING_MARGIN, Route, Router
from pagedllm.engine.structured_output import grammar_text
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.core.kv_view import KVSnapshot

logger = logging.getLogger("pagedllm.engine.replica_pool")
NAMESPACE = "pagedllm"
# A Ray instance the server starts for itself talks over loopback only, and reports no usage statistics.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class ReplicaDiedError(EngineDeadError):
    """The replica serving this request died after the request had produced output; it cannot resume elsewhere."""


@dataclass
class PoolConfig:
    """How many replicas, how requests reach them, where Ray runs, how faults are watched."""

    num_replicas: int
    routing: str = "prefix-affinity"
    routing_margin: int = DEFAULT_ROUTING_MARGIN  # in-flight requests a prefix's replica may have over the least
    index_blocks: int | None = None  # per replica; default: the replica's KV pool, which holds no more
    ray_address: str | None = None  # None: start a local Ray instance for the server's lifetime
    max_waiting_requests: int = ServerConfig.max_waiting_requests
    kv_snapshot_rate: float | None = None  # KV snapshots a second per replica while it works (None: none)
    health_interval: float = 1.0
    health_timeout: float = 10.0
    max_restarts: int = 1000
    startup_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"data_parallel_size must be positive, got {self.num_replicas}")
        if self.routing_margin < 0:
            raise ValueError(f"routing_margin must be non-negative, got {self.routing_margin}")


def package_runtime_env() -> dict[str, Any]:
    """Ray workers must import pagedllm: from a source tree (or an editable install) its folder goes on their path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
    if "site-packages" in root:
        return {}
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}


def init_ray(address: str | None) -> bool:
    """Connect to the Ray cluster at `address` ("auto", HOST:PORT), or start a local instance; True if this call
    initialised Ray (so shutdown disconnects, and stops the local instance)."""
    if address is None:
        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
    try:
        import ray
    except ImportError:
        raise ValueError("several replicas need Ray: pip install 'pagedllm[ray]'") from None

    if ray.is_initialized():
        return False
    ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, runtime_env=package_runtime_env(),
             log_to_driver=True)
    return True


def reaches_the_client(output: RequestOutput, params: SamplingParams) -> bool:
    """Whether a streaming reader sends anything for this output: text, or with logprobs any token. Until one does,
    the request may still start over on another replica (the detokenizer can hold a first token's text back)."""
    return params.logprobs is not None or any(c.text for c in output.outputs)


class PoolStream(RequestStream):
    """One request's outputs as they come from whichever replica serves it; cancelling it aborts the request."""

    def __init__(self, pool: ReplicaPool, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.finished = False
        self.delivered = False  # an output the reader sends on reached the stream: the request cannot move...
        self.restartable = False  # ...unless its reader needs only the final output
        self.route: Route | None = None
        self.tried: set[int] = set()  # replicas that failed this request
        self._pool = pool
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def cancel(self) -> None:
        """Abort the request if it is still running (a no-op once it finished)."""
        if not self.finished:
            self.finished = True
            self._pool.abort(self.request_id)

    def allow_restart(self) -> None:
        """Only the final output is read: if the replica dies, the request may start over on another one."""
        self.restartable = True

    @property
    def movable(self) -> bool:
        return not self.delivered or self.restartable


@dataclass
class Replica:
    """The pool's view of one replica actor."""

    index: int
    actor: Any
    name: str
    boot_id: str | None = None
    healthy: bool = False
    restarts: int = 0
    status: ReplicaStatus | None = None
    requests: dict[str, PoolStream] = field(default_factory=dict)  # in flight here
    listener: asyncio.Task | None = None


class ReplicaPool(EngineClient):
    """N engine replicas as Ray actors, placed by CPU resources, behind one router."""

    def __init__(self, config: EngineConfig, pool_config: PoolConfig,
                 observer_factory: Callable[[], ServingObserver] | None = None) -> None:
        from pagedllm.model.loader import load_tokenizer

        self.pool_config = pool_config
        self.max_waiting_requests = pool_config.max_waiting_requests
        n = pool_config.num_replicas
        threads = config.threads or max(1, cpu_budget().usable // n)
        self.config = dataclasses.replace(config, threads=threads)
        self.tokenizer = load_tokenizer(config.model)  # fails fast on a bad --model, before any replica starts
        self.owns_ray = init_ray(pool_config.ray_address)
        import ray

        self._ray = ray
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < n * threads:
            self._disconnect()
            raise ValueError(f"{n} replicas x {threads} threads need {n * threads} CPUs; the Ray cluster has "
                             f"{cpus:g} (pass --threads, or add nodes)")
        actor_class = ray.remote(EngineReplica)
        prefix = f"pagedllm-replica-{os.getpid()}"
        self.replicas = [Replica(i, actor_class.options(
            name=f"{prefix}-{i}", namespace=NAMESPACE, num_cpus=threads, max_restarts=pool_config.max_restarts,
            max_task_retries=0, max_concurrency=10_000).remote(self.config, pool_config.max_waiting_requests,
                                                               observer_factory, pool_config.kv_snapshot_rate),
            f"{prefix}-{i}")
            for i in range(n)]
        try:
            infos: list[ReplicaInfo] = ray.get([r.actor.info.remote() for r in self.replicas],
                                               timeout=pool_config.startup_timeout)
        except BaseException:
            self._kill_actors()
            self._disconnect()
            raise
        first = infos[0]
        self.model_name, self.max_model_len, self.vocab_size = first.model_name, first.max_model_len, first.vocab_size
        self.max_prompt_chars: int | None = self.max_model_len * self.tokenizer.max_token_chars
        self.router = Router(n, first.block_size, pool_config.routing, pool_config.routing_margin,
                             pool_config.index_blocks or first.num_blocks)
        for replica, info in zip(self.replicas, infos):
            replica.boot_id = info.boot_id
        self.streams: dict[str, PoolStream] = {}
        self.kv_listener: Callable[[int, KVSnapshot], None] | None = None
        self.health_task: asyncio.Task | None = None
        logger.info("%d replicas of %s up (%d threads each, routing %s)", n, self.model_name, threads,
                    pool_config.routing)

    # ---- the engine client's surface -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start listening to every replica and checking their health; call from the server's event loop."""
        for replica in self.replicas:
            self._listen(replica)
            self._set_healthy(replica, True)
        self.health_task = asyncio.ensure_future(self._health_loop())

    def shutdown(self) -> None:
        tasks = [self.health_task, *(r.listener for r in self.replicas)]
        for task in tasks:
            if task is not None:
                task.cancel()
        for stream in list(self.streams.values()):
            stream.put(EngineDeadError("the server is shutting down"))
        self.streams.clear()
        self._kill_actors()
        self._disconnect()

    @property
    def is_alive(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError("no replica is healthy")

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, self.vocab_size, self.max_model_len)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """The grammar's limits checked here (a 400 before any replica sees it); a replica compiles it when the
        request reaches it (one it refuses fails the request's stream with the same InvalidRequestError)."""
        await asyncio.to_thread(grammar_text, spec)

    @property
    def num_waiting(self) -> int:
        """Requests in flight beyond those the replicas said they were running at the last health check."""
        return sum(max(0, len(r.requests) - (r.status.num_running if r.status else 0)) for r in self.replicas)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences of the requests in flight with no output yet (one moved off a failed replica waits again)."""
        return sum(s.params.n for s in self.streams.values() if not s.delivered)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> PoolStream:
        """Route the request and send it to its replica; outputs (or the error) arrive on the returned stream."""
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize_prompt(prompt)
        stream = PoolStream(self, request_id, ids, params)
        self.streams[request_id] = stream
        self._dispatch(stream)
        return stream

    def abort(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is None or stream.route is None:
            return
        replica = self.replicas[stream.route.replica]
        replica.requests.pop(request_id, None)
        self._release(stream)
        with contextlib.suppress(Exception):
            replica.actor.abort.remote(request_id)

    # ---- observability -------------------------------------------------------------------------------------------
    def replica_metrics(self) -> list[tuple[int, str]]:
        """Each replica's Prometheus text from its last health check."""
        return [(r.index, r.status.metrics_text) for r in self.replicas if r.status and r.status.metrics_text]

    def replica_health(self) -> list[dict[str, Any]]:
        """Per replica: health, restarts, queues as last reported, and the router's counts."""
        return [{"replica": r.index, "actor": r.name, "healthy": r.healthy, "restarts": r.restarts,
                 "num_running": r.status.num_running if r.status else None,
                 "num_waiting": r.status.num_waiting if r.status else None,
                 "in_flight": len(r.requests), "routed": self.router.replicas[r.index].routed}
                for r in self.replicas]

    def watch_kv(self, listener: Callable[[int, KVSnapshot], None]) -> None:
        """`listener(replica, snapshot)` on the event loop for every KV snapshot a replica takes (PoolConfig's
        kv_snapshot_rate); per replica, in order: a full one first (also after a restart), then diffs."""
        self.kv_listener = listener

    # ---- routing and outputs -------------------------------------------------------------------------------------
    def _dispatch(self, stream: PoolStream) -> None:
        try:
            route = self.router.route(stream.prompt_token_ids, stream.params.max_tokens or 0, exclude=stream.tried)
        except LookupError:
            self._end(stream, EngineDeadError("no healthy replica can take this request"))
            return
        stream.route = route
        replica = self.replicas[route.replica]
        replica.requests[stream.request_id] = stream
        replica.actor.add.remote(stream.request_id, stream.prompt_token_ids, stream.params)

    def _deliver(self, replica: Replica, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = replica.requests.get(request_id)
        if stream is None:  # cancelled meanwhile, or sent to an incarnation that was given up on
            replica.actor.abort.remote(request_id)
            return
        if isinstance(item, EngineDeadError) and stream.movable:
            self._reroute(stream, replica)
        elif isinstance(item, BaseException):
            self._end(stream, item)
        else:
            stream.delivered = stream.delivered or reaches_the_client(item, stream.params)
            if item.finished:
                self._end(stream, item)
            else:
                stream.put(item)

    def _deliver_snapshot(self, replica: Replica, snap: KVSnapshot) -> None:
        if self.kv_listener is not None:
            try:
                self.kv_listener(replica.index, snap)
            except Exception:  # the dashboard must never take the outputs down
                logger.exception("the KV snapshot listener failed")

    def _end(self, stream: PoolStream, last: RequestOutput | BaseException) -> None:
        """The request is over here: its last output or error goes to the stream, its load off the router."""
        if stream.route is not None:
            self.replicas[stream.route.replica].requests.pop(stream.request_id, None)
        self._release(stream)
        self.streams.pop(stream.request_id, None)
        stream.put(last)

    def _release(self, stream: PoolStream) -> None:
        if stream.route is not None:
            self.router.finish(stream.route)
            stream.route = None

    def _reroute(self, stream: PoolStream, failed: Replica) -> None:
        """A request that produced nothing on a failed replica (or whose reader waits for the final output only)
        goes to another one."""
        failed.requests.pop(stream.request_id, None)
        self._release(stream)
        stream.tried.add(failed.index)
        self.router.rerouted += 1
        logger.warning("request %s routed again: replica %d failed", stream.request_id, failed.index)
        self._dispatch(stream)

    def _replica_failed(self, replica: Replica, error: BaseException) -> None:
        """Stop routing to the replica; move its requests that had no output, fail the others."""
        if replica.healthy:
            logger.error("replica %d failed: %r", replica.index, error)
        self._set_healthy(replica, False)
        for stream in list(replica.requests.values()):
            if not stream.movable:
                self._end(stream, ReplicaDiedError(f"replica {replica.index} failed while serving this request; "
                                                   "retry it"))
            else:
                self._reroute(stream, replica)

    def _set_healthy(self, replica: Replica, healthy: bool, restarted: bool = False) -> None:
        replica.healthy = healthy
        self.router.set_healthy(replica.index, healthy, restarted)

    def _listen(self, replica: Replica) -> None:
        if replica.listener is not None:
            replica.listener.cancel()
        replica.listener = asyncio.ensure_future(self._consume(replica))

    async def _consume(self, replica: Replica) -> None:
        """The replica's output stream, for as long as the replica lives."""
        try:
            async for ref in replica.actor.outputs.options(num_returns="streaming").remote():
                for request_id, item in await ref:
                    if request_id == KV_SNAPSHOT:
                        self._deliver_snapshot(replica, item)
                    else:
                        self._deliver(replica, request_id, item)
            raise EngineDeadError("the replica's output stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._replica_failed(replica, e)

    # ---- health --------------------------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.pool_config.health_interval)
            await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, replica: Replica) -> None:
        """One health check: a dead or unanswering replica is taken out; a new incarnation is taken back in."""
        try:
            status: ReplicaStatus = await asyncio.wait_for(replica.actor.status.remote(),
                                                           self.pool_config.health_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # dead, restarting, or stuck
            self._replica_failed(replica, e)
            return
        replica.status = status
        if not status.alive:  # the actor lives but its engine loop died: Ray restarts it once killed
            self._replica_failed(replica, EngineDeadError("the replica's engine loop stopped"))
            self._ray.kill(replica.actor, no_restart=False)
            return
        restarted = status.boot_id != replica.boot_id
        if restarted:
            replica.restarts += 1
            replica.boot_id = status.boot_id
            self._replica_failed(replica, EngineDeadError("the replica restarted"))  # what the old one held is gone
            logger.warning("replica %d is back (restart %d)", replica.index, replica.restarts)
        if restarted or replica.listener is None or replica.listener.done():
            self._listen(replica)
        if restarted or not replica.healthy:
            self._set_healthy(replica, True, restarted)

    def _kill_actors(self) -> None:
        for replica in getattr(self, "replicas", []):
            with contextlib.suppress(Exception):
                self._ray.kill(replica.actor, no_restart=True)

    def _disconnect(self) -> None:
        if self.owns_ray:
            self._ray.shutdown()
            self.owns_ray = False
