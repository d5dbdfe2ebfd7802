"""`pagedllm replay TRACE`: the KV cache dashboard over a trace recorded by `pagedllm bench throughput --trace`."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pagedllm.config import ServerConfig

if TYPE_CHECKING:
    from fastapi import FastAPI


def build_replay_app(path: str) -> FastAPI:
    from fastapi import FastAPI

    from pagedllm.entrypoints.openai.dashboard import Replay, mount

    app = FastAPI(title="pagedllm replay")
    mount(app, Replay(path))
    return app


def add_replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a JSONL trace written by `pagedllm bench throughput --trace PATH`")
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.port)
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.http_limits import ConnectionLimits, uvicorn_config_kwargs
    from pagedllm.entrypoints.serve import uvicorn_server

    app = build_replay_app(args.trace)
    print(f"Replaying {args.trace} ({app.state.dashboard.info()['frames']} frames): "
          f"open http://{args.host}:{args.port}/dashboard")
    uvicorn_server(app, host=args.host, port=args.port, log_level="warning",
                   **uvicorn_config_kwargs(ConnectionLimits())).run()
    return 0
