"""`pagedllm serve`: an engine (or `--data-parallel-size` replicas of it) wired to the OpenAI-compatible app, its
metrics and its dashboard, run by uvicorn. The app itself knows only the engine client (openai/app.py)."""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.engine.router import DEFAULT_ROUTING_MARGIN, ROUTING_POLICIES
from pagedllm.entrypoints.http_limits import ConnectionLimits, uvicorn_config_kwargs
from pagedllm.frozen_imports import frozen_imports

if TYPE_CHECKING:  # fastapi, uvicorn and the engine are imported where used: `serve --help` needs none of them
    import uvicorn
    from fastapi import FastAPI

    from pagedllm.engine.protocol import SteppedEngine


def build_app(engine: SteppedEngine, model_names: list[str], server: ServerConfig | None = None,
              model_path: str | None = None, engine_factory: Callable[[], SteppedEngine] | None = None,
              log_interval: float = 5.0, named_clients: Iterable[str] = ()) -> FastAPI:
    """The app over an already loaded LLMEngine; the engine thread lives as long as the app. With an
    `engine_factory` an engine that breaks is replaced by a fresh one (without, it stays down). `named_clients`
    (those of --client-weights) always get their own label in the per-client metrics."""
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.protocol import ServingObserver
    from pagedllm.entrypoints.openai import dashboard
    from pagedllm.entrypoints.openai.app import build_client_app
    from pagedllm.entrypoints.openai.metrics import EngineStats

    server = server or ServerConfig()
    stats = EngineStats(model_names[0], log_interval=log_interval, named_clients=named_clients)
    rate = server.dashboard
    hub = dashboard.DashboardHub(model_names[0], rate, hide_prompts=bool(server.api_key),
                                 max_streams=server.max_dashboard_streams,
                                 send_timeout=server.stream_send_timeout) if rate else None
    members: list[ServingObserver] = [stats, *([hub] if hub else [])]
    if server.service_trace:
        from pagedllm.entrypoints.service_trace import ServiceTrace
        members.append(ServiceTrace(server.service_trace))
    observer: ServingObserver = stats if len(members) == 1 else dashboard.Observers(*members)
    client = AsyncLLMEngine(engine, server.max_waiting_requests, observer=observer, engine_factory=engine_factory)
    app = build_client_app(client, stats, model_names, server, model_path,
                           on_start=None if hub is None else lambda: hub.start(engine))
    if hub is not None:
        dashboard.mount(app, hub)
    return app


def uvicorn_server(app: FastAPI, **config: Any) -> uvicorn.Server:
    """uvicorn's server for `app`; on Ctrl+C or SIGTERM it first ends the dashboard's event streams, which would
    otherwise keep it waiting for their connections to close (as long as a page stays open)."""
    import uvicorn

    from pagedllm.entrypoints.openai import dashboard

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            dashboard.close(app)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, **config))


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """`pagedllm serve`: the OpenAI-compatible server, with every engine flag."""
    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    ServerConfig.add_cli_args(p)
    ConnectionLimits.add_cli_args(p)
    add_data_parallel_args(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    with frozen_imports():  # torch's and the engine's objects: out of the collector's way
        from pagedllm.engine.async_engine import build_serving_engine
        from pagedllm.engine.llm_engine import LLMEngine

    server = ServerConfig.from_cli_args(args)
    connections = ConnectionLimits.from_cli_args(args)
    if args.data_parallel_size <= 0:
        raise ValueError(f"--data-parallel-size must be positive, got {args.data_parallel_size}")
    set_log_levels(server)
    if args.data_parallel_size > 1:
        if server.service_trace:
            raise ValueError("--service-trace records one engine's steps: not with --data-parallel-size")
        app = build_data_parallel_app(args, server)
    else:
        config = EngineConfig.from_cli_args(args)
        engine = build_serving_engine(config)
        names = server.served_model_name or [args.model or engine.model_name]
        app = build_app(engine, names, server, model_path=args.model or engine.model_name,
                        engine_factory=functools.partial(LLMEngine, config), named_clients=config.client_weights or ())
    uvicorn_server(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level,
                   timeout_keep_alive=server.timeout_keep_alive, **uvicorn_config_kwargs(connections)).run()
    return 0


def set_log_levels(server: ServerConfig) -> None:
    """A line per finished request and a periodic throughput line unless switched off; a server reports its model
    and KV cache at start."""
    loggers = {"pagedllm.requests": server.disable_log_requests, "pagedllm.stats": server.disable_log_stats}
    for name, disabled in loggers.items():
        logging.getLogger(name).setLevel(logging.WARNING if disabled else logging.INFO)
    if logging.getLogger().level > logging.INFO:
        logging.getLogger("pagedllm").setLevel(logging.INFO)


# ---- several replicas (`--data-parallel-size N`): Ray actors behind the router ------------------------------------
def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallel (Ray)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each a Ray actor with its own --threads, KV cache and prefix cache")
    g.add_argument("--routing", default="prefix-affinity", choices=ROUTING_POLICIES,
                   help="which replica takes a request: the longest cached prefix (unless that replica is "
                        "--routing-margin requests busier than the least loaded), the least loaded, or in turn")
    g.add_argument("--routing-margin", type=int, default=DEFAULT_ROUTING_MARGIN,
                   help="requests in flight a prefix's replica may have above the least-loaded one")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (auto, or HOST:PORT of `ray start --head`); default: start a local "
                        "Ray instance that lives as long as the server")


def build_data_parallel_app(args: argparse.Namespace, server: ServerConfig) -> FastAPI:
    """N replicas behind one endpoint, with a dashboard that shows one replica's KV cache at a time; ray is imported
    only here."""
    from pagedllm.engine.replica_pool import PoolConfig, ReplicaPool
    from pagedllm.entrypoints.openai import dashboard
    from pagedllm.entrypoints.openai.app import build_client_app
    from pagedllm.entrypoints.openai.metrics import EngineStats, ReplicaSetStats

    pool_config = PoolConfig(args.data_parallel_size, args.routing, args.routing_margin,
                             ray_address=args.ray_address, max_waiting_requests=server.max_waiting_requests,
                             kv_snapshot_rate=server.dashboard)
    name = (server.served_model_name or [None])[0]
    observer = functools.partial(EngineStats, name or args.model or "default",
                                 named_clients=tuple(args.client_weights or ()))
    pool = ReplicaPool(EngineConfig.from_cli_args(args), pool_config, observer_factory=observer)
    names = server.served_model_name or [args.model or pool.model_name]
    rate = server.dashboard
    hub = dashboard.ReplicaDashboard(pool, names[0], rate, hide_prompts=bool(server.api_key),
                                     max_streams=server.max_dashboard_streams,
                                     send_timeout=server.stream_send_timeout) if rate else None
    app = build_client_app(pool, ReplicaSetStats(pool, names[0]), names, server, args.model or pool.model_name,
                           on_start=None if hub is None else hub.start)
    if hub is not None:
        dashboard.mount(app, hub)
    return app
