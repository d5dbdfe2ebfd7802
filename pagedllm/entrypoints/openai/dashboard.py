"""`/dashboard`: a live view of the paged KV cache (the block pool, each request's block tables, the events), and
the same page over a trace recorded by `pagedllm bench throughput --trace` (`pagedllm replay`, entrypoints/replay.py).

Snapshots are taken on the engine thread, by `DashboardHub.record` (an async-engine observer): at most `rate` a
second while the engine works, and once more when it goes idle, so nothing asks the engine faster than it steps.
Each is a diff; the hub applies it to its copy of the pool on the event loop and fans it out to the page's event
streams, so a new page gets the whole picture at once without asking the engine. The page is static HTML + JS
(package data, no build step, no CDN). It is open like /metrics; with --api-key it does not show prompts' words.

Under --data-parallel-size each replica has its own pool, so the page shows one replica at a time
(`/dashboard?replica=i`) beside every replica's headline numbers: `ReplicaDashboard` keeps one hub per replica, fed
with the snapshots each replica takes on its own engine thread by the same rule and sends on its output stream
(the engine client's `watch_kv`).

Its event streams are bounded like the completions' streams: at most --max-dashboard-streams at once (503 past
them), each dropped once its client has read nothing for --stream-send-timeout; the full frame a new or lagging page
gets is built once per snapshot, however many pages ask for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from pagedllm.config import ServerConfig
from pagedllm.engine.protocol import ReplicaSetClient, ServingObserver, SteppedEngine
from pagedllm.entrypoints.kv_trace import frame_of, history_point, read_trace, to_json
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import DeadlineStreamingResponse
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm.entrypoints.openai.dashboard")
STATIC = resources.files("pagedllm.entrypoints.openai") / "static"
KEEP_ALIVE_S = 15.0
RECENT_EVENTS = 300  # events a new page gets
HISTORY_POINTS = 2400  # time-series points a new page gets (10 minutes at 4 a second)
RESYNC = "resync"  # put in a slow page's queue instead of the frames it missed: it gets a full frame
CLOSE = "close"  # ends a page's stream (frames are JSON objects, never these words)


class DashboardHub:
    """KV snapshots from the engine thread to every open page; keeps the pool's latest state for new pages."""

    def __init__(self, model: str, rate: float = 4.0, hide_prompts: bool = False,
                 max_streams: int = ServerConfig.max_dashboard_streams,
                 send_timeout: float = ServerConfig.stream_send_timeout) -> None:
        if rate <= 0:
            raise ValueError(f"--dashboard-rate must be positive, got {rate}")
        self.model, self.period, self.hide_prompts = model, 1.0 / rate, hide_prompts
        self.max_streams, self.send_timeout = max_streams, send_timeout
        self.full_cache: tuple[int, str] | None = None  # (num_snapshots, the full frame built then)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.version: int | None = None  # engine thread: the last snapshot taken
        self.last_taken = 0.0
        self.latest: Any = None  # event loop: the last snapshot published, and the pool it leaves
        self.states = bytearray()
        self.refs: list[int] = []
        self.events: deque[Any] = deque(maxlen=RECENT_EVENTS)
        self.history: deque[list[float]] = deque(maxlen=HISTORY_POINTS)
        self.subscribers: set[asyncio.Queue[str]] = set()
        self.num_snapshots = 0
        self.closed = False

    def start(self, engine: SteppedEngine) -> None:
        """On the event loop, before the engine thread starts: the first (full) snapshot. A dashboard that cannot
        start is switched off, never the server."""
        try:
            self.publish(self.take(engine))
        except Exception:
            logger.exception("the dashboard is off: the first KV snapshot failed")
            return
        self.loop = asyncio.get_running_loop()

    # ---- engine thread ------------------------------------------------------------------------------------
    def record(self, engine: SteppedEngine, outputs: list[RequestOutput]) -> None:
        """After every step (and after aborts): a snapshot if the last is `period` old, or if the engine is idle."""
        now = time.monotonic()
        busy = engine.num_running or engine.num_waiting
        if self.loop is None or self.loop.is_closed() or (busy and now - self.last_taken < self.period):
            return
        self.last_taken = now
        self.loop.call_soon_threadsafe(self.publish, self.take(engine))

    def record_restart(self) -> None:
        """Nothing to count: the next snapshot comes from the fresh engine."""

    def take(self, engine: SteppedEngine) -> Any:
        return self.accept(engine.kv_snapshot(self.version))

    def accept(self, snap: Any) -> Any:
        """Note the snapshot's version (the next is asked as a diff since it); blank the prompts if hidden."""
        self.version = snap.version
        if self.hide_prompts:
            for request in snap.requests:
                request.prompt = ""
        return snap

    # ---- event loop ---------------------------------------------------------------------------------------
    def publish(self, snap: Any) -> None:
        """Apply the snapshot to the hub's pool and send it to every page."""
        if snap.full:
            self.states, self.refs = bytearray(snap.num_blocks), [0] * snap.num_blocks
        blocks = snap.blocks
        for i in range(0, len(blocks), 3):
            self.states[blocks[i]], self.refs[blocks[i]] = blocks[i + 1], blocks[i + 2]
        self.latest = snap
        self.num_snapshots += 1
        self.events.extend(snap.events)
        self.history.append(history_point(snap))
        if not self.subscribers:
            return
        frame = to_json(frame_of(snap))
        for queue in self.subscribers:
            self._put(queue, frame, RESYNC)  # a page that does not keep up skips to the present

    @staticmethod
    def _put(queue: asyncio.Queue[str], item: str, instead: str) -> None:
        """`item`, or if the queue is full, `instead` of everything in it."""
        if queue.full():
            while not queue.empty():
                queue.get_nowait()
            item = instead
        queue.put_nowait(item)

    def close(self) -> None:
        """End every page's stream (thread-safe): uvicorn waits for open connections before it stops, and an
        event stream never ends by itself."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._close)

    def _close(self) -> None:
        self.closed = True
        for queue in self.subscribers:
            self._put(queue, CLOSE, CLOSE)

    def full_frame(self) -> str:
        """The whole picture as one full frame: every block not free, the latest requests and counters, the recent
        events and the time series so far; built once per snapshot (pages that connect or lag together share it)."""
        if self.full_cache is None or self.full_cache[0] != self.num_snapshots:
            self.full_cache = (self.num_snapshots, self.build_full_frame())
        return self.full_cache[1]

    def build_full_frame(self) -> str:
        snap = self.latest
        if snap is None:
            return to_json({"full": True, "mode": "live", "model": self.model, "error": "no snapshot yet"})
        blocks: list[int] = []
        for b, state in enumerate(self.states):
            if state:
                blocks += (b, state, self.refs[b])
        return to_json(frame_of(snap, full=True, blocks=blocks, events=list(self.events),
                                history=list(self.history), mode="live", model=self.model))

    def subscribe(self) -> asyncio.Queue[str]:
        """A new page's queue, or a 503 past `max_streams` pages (each costs the event loop a send per frame)."""
        if len(self.subscribers) >= self.max_streams:
            raise APIError(503, f"{len(self.subscribers)} dashboard streams are open, the most allowed "
                           "(--max-dashboard-streams); close one or retry later", "server_error",
                           code="too_many_streams", headers={"Retry-After": "5"})
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=64)
        self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[str]) -> None:
        self.subscribers.discard(queue)

    def info(self) -> dict[str, Any]:
        return {"mode": "live", "model": self.model, "rate": 1.0 / self.period, "hide_prompts": self.hide_prompts}

    def headline(self) -> dict[str, Any]:
        """The latest snapshot's figures for a replica selector: KV use, queues, tokens/s, prefix hit rate."""
        snap = self.latest
        if snap is None:
            return {"snapshots": 0}
        c = snap.counters
        return {"snapshots": self.num_snapshots, "time": snap.time, "num_blocks": c.num_blocks,
                "blocks_in_use": c.blocks_in_use, "blocks_cached_free": c.blocks_cached_free,
                "num_running": c.num_running, "num_waiting": c.num_waiting, "preemptions": c.preemptions,
                "generated_tokens": c.generated_tokens, "tokens_per_s": self.token_rate() if c.num_running else 0.0,
                "prefix_cache_hit_rate": c.prefix_cache_hits / c.prefix_cache_queries if c.prefix_cache_queries
                else None}

    def token_rate(self, window: float = 5.0) -> float:
        """Generated tokens a second over the last `window` seconds of the time series."""
        if len(self.history) < 2:
            return 0.0
        last = self.history[-1]
        first = next((p for p in reversed(self.history) if p[0] <= last[0] - window), self.history[0])
        return (last[5] - first[5]) / (last[0] - first[0]) if last[0] > first[0] else 0.0


class ReplicaDashboard:
    """Under --data-parallel-size: one hub per replica, fed with the snapshots the replica takes on its engine
    thread (at most `rate` a second while it works, once when it goes idle) and sends on its output stream (the
    client's `watch_kv`). A replica that fails keeps its last picture until it is back (then a full snapshot)."""

    def __init__(self, client: ReplicaSetClient, model: str, rate: float = 4.0, hide_prompts: bool = False,
                 max_streams: int = ServerConfig.max_dashboard_streams,
                 send_timeout: float = ServerConfig.stream_send_timeout) -> None:
        self.client = client
        self.hubs = [DashboardHub(model, rate, hide_prompts, max_streams, send_timeout)
                     for _ in client.replica_health() or []]

    def start(self) -> None:
        """On the event loop, before the client starts."""
        for hub in self.hubs:
            hub.loop = asyncio.get_running_loop()
        self.client.watch_kv(self.receive)

    def receive(self, replica: int, snap: Any) -> None:
        """On the event loop: a replica's snapshot to its hub (a diff before the hub has a full one is dropped)."""
        hub = self.hubs[replica]
        if snap.full or len(hub.states) == snap.num_blocks:
            hub.publish(hub.accept(snap))

    def hub(self, replica: str | None) -> DashboardHub:
        """The hub of `?replica=` (replica 0 if not given)."""
        index = 0 if not replica else int(replica) if replica.isdigit() else -1
        if not 0 <= index < len(self.hubs):
            raise HTTPException(404, f"no replica {replica!r}: there are {len(self.hubs)} (0-{len(self.hubs) - 1})")
        return self.hubs[index]

    def info(self, replica: str | None) -> dict[str, Any]:
        """The selected replica's page info, with every replica's health and headline numbers."""
        index = self.hubs.index(self.hub(replica))
        health = self.client.replica_health() or []
        replicas = [{"replica": i, **hub.headline(), **{k: h[k] for k in ("healthy", "restarts", "in_flight")}}
                    for i, (hub, h) in enumerate(zip(self.hubs, health))]
        return {**self.hubs[index].info(), "replica": index, "replicas": replicas}

    def close(self) -> None:
        """End every page's stream (thread-safe)."""
        for hub in self.hubs:
            hub.close()


class Replay:
    """A recorded trace, for `pagedllm replay`: the page fetches it whole and plays it with a time slider."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.header, self.frames = read_trace(path)

    def info(self) -> dict[str, Any]:
        return {"mode": "replay", "model": self.header.get("model"), "path": self.path, "frames": len(self.frames)}


class Observers(ServingObserver):
    """Several async-engine observers as one (the async engine takes one): each failure is logged on its own."""

    def __init__(self, *observers: ServingObserver) -> None:
        self.members = observers

    def record(self, engine: SteppedEngine, outputs: list[RequestOutput]) -> None:
        for observer in self.members:
            try:
                observer.record(engine, outputs)
            except Exception:
                logger.exception("observer %s failed", type(observer).__name__)

    def record_restart(self) -> None:
        """Called from the thread that replaces a broken engine: a failing member must not stop that thread."""
        for observer in self.members:
            try:
                observer.record_restart()
            except Exception:
                logger.exception("observer %s failed to record a restart", type(observer).__name__)


# ---- routes ----------------------------------------------------------------------------------------------------
router = APIRouter()


def source_of(request: Request) -> DashboardHub | Replay:
    """The app's hub or replay; under --data-parallel-size the hub of the replica in `?replica=` (0 by default)."""
    source = request.app.state.dashboard
    if isinstance(source, ReplicaDashboard):
        return source.hub(request.query_params.get("replica"))
    return source


def static_text(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard_page() -> HTMLResponse:
    return HTMLResponse(static_text("dashboard.html"))


@router.get("/dashboard/dashboard.js")
async def dashboard_script() -> Response:
    return Response(static_text("dashboard.js"), media_type="text/javascript")


@router.get("/dashboard/info")
async def dashboard_info(raw: Request) -> JSONResponse:
    source = raw.app.state.dashboard
    if isinstance(source, ReplicaDashboard):
        return JSONResponse(source.info(raw.query_params.get("replica")))
    return JSONResponse(source.info())


@router.get("/dashboard/snapshot")
async def dashboard_snapshot(raw: Request) -> Response:
    """The live page's first frame, for curl and tests."""
    source = source_of(raw)
    if not isinstance(source, DashboardHub):
        return JSONResponse({"error": "a replay has no live snapshot: see /dashboard/trace"}, 404)
    return Response(source.full_frame(), media_type="application/json")


@router.get("/dashboard/events")
async def dashboard_events(raw: Request) -> Response:
    """Server-sent events: a full frame, then every snapshot the hub publishes (a comment every 15 s when idle)."""
    hub = source_of(raw)
    if not isinstance(hub, DashboardHub):
        return JSONResponse({"error": "a replay has no live events: see /dashboard/trace"}, 404)
    try:
        queue = hub.subscribe()  # here, not in the stream: a crowd arriving at once is counted as it comes
    except APIError as e:
        return e.response()
    return EventStreamResponse(hub, queue)


class EventStreamResponse(DeadlineStreamingResponse):
    """A page's event stream: dropped when its client stops reading; its subscription ends with it, however it
    ends (also if the stream never started)."""

    def __init__(self, hub: DashboardHub, queue: asyncio.Queue[str]) -> None:
        super().__init__(event_stream(hub, queue), hub.send_timeout, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.hub, self.queue = hub, queue

    def closed(self) -> None:
        self.hub.unsubscribe(self.queue)


async def event_stream(hub: DashboardHub, queue: asyncio.Queue[str]) -> AsyncIterator[str]:
    try:
        yield f"data: {hub.full_frame()}\n\n"
        while not hub.closed:
            try:
                frame = await asyncio.wait_for(queue.get(), KEEP_ALIVE_S)
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if frame == CLOSE:
                return
            yield f"data: {hub.full_frame() if frame == RESYNC else frame}\n\n"
    finally:
        hub.unsubscribe(queue)


@router.get("/dashboard/trace")
async def dashboard_trace(raw: Request) -> Response:
    """The whole trace as JSONL (header first), for the page's player."""
    replay = source_of(raw)
    if not isinstance(replay, Replay):
        return JSONResponse({"error": "no trace: this server is live, see /dashboard/events"}, 404)
    return Response("\n".join([to_json(replay.header), *replay.frames]) + "\n", media_type="application/x-ndjson")


def mount(app: FastAPI, source: DashboardHub | ReplicaDashboard | Replay) -> None:
    app.state.dashboard = source
    app.include_router(router)


def close(app: FastAPI) -> None:
    """End the live dashboard's event streams, if the app has one (thread-safe)."""
    source = getattr(app.state, "dashboard", None)
    if isinstance(source, (DashboardHub, ReplicaDashboard)):
        source.close()
