"""The OpenAI-compatible app over an engine client: /v1/completions, /v1/chat/completions, /v1/responses (with its
stored responses), Anthropic's /v1/messages, /v1/models and vLLM's /health, /metrics, /tokenize, /detokenize,
/version, /v1/load_lora_adapter and /v1/unload_lora_adapter. Each endpoint module brings its own router; an endpoint
is one more module in `ROUTERS`.

Every bad request is a 4xx with an OpenAI-style body, never a 500 (errors.py); a client that goes away aborts its
requests; a request whose sequences (prompts x n) would take the waiting ones past --max-waiting-requests gets 503 +
Retry-After (400 if it alone asks for more).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from pagedllm import __version__
from pagedllm.config import ServerConfig
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai import (
    routes,
    serving_chat,
    serving_completion,
    serving_lora,
    serving_messages,
    serving_responses,
)
from pagedllm.entrypoints.openai.errors import UTILITY_ROUTES, ApiKeyMiddleware, install_error_handlers
from pagedllm.entrypoints.openai.limits import RequestLimitMiddleware, WorkerPool, utility_pool
from pagedllm.entrypoints.openai.metrics import EngineStats, ReplicaSetStats
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving import ServerContext

ROUTERS: list[APIRouter] = [serving_completion.router, serving_chat.router, serving_responses.router,
                            serving_messages.router, serving_lora.router, routes.router]


def build_client_app(engine: EngineClient, stats: EngineStats | ReplicaSetStats, model_names: list[str],
                     server: ServerConfig | None = None, model_path: str | None = None,
                     on_start: Callable[[], None] | None = None) -> FastAPI:
    """The app over an engine client (an AsyncLLMEngine, or a ReplicaPool of several), started and shut down with
    the app; `stats.registry` is what /metrics serves; `on_start` runs first (the dashboard's first snapshot).
    Of `server`, the app uses the API key, the limits on request bodies and streams, and the bounds of the
    stored responses."""
    server = server or ServerConfig()
    workers = WorkerPool()
    utility_workers = utility_pool()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_start is not None:
            on_start()  # before the engine thread owns the engine
        engine.start()
        try:
            for name, path in serving_lora.parse_lora_modules(server.lora_modules):  # --lora-modules
                await context.loras.load(engine, name, path)
            yield
        finally:
            engine.shutdown()
            workers.shutdown()
            utility_workers.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    context = ServerContext(engine, stats, model_names, model_path, workers, utility_workers,
                            server.stream_send_timeout, server.default_max_tokens)
    app.state.server = context
    app.state.responses = ResponseStore(server.responses_store_size, server.responses_store_ttl)
    install_error_handlers(app)
    if server.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server.api_keys,
                           also=UTILITY_ROUTES if server.api_key_utility_routes else ())
    app.add_middleware(RequestLimitMiddleware, max_bytes=server.max_request_bytes, timeout=server.body_timeout)
    for router in ROUTERS:
        app.include_router(router)
    return app
