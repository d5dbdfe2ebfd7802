"""How failures reach an OpenAI client: every bad request is a 4xx with an OpenAI-style body
{"error": {message, type, param, code}}, never a 500; overload and a dead or restarting engine are 503s; and the
API key that guards /v1."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.engine.protocol import EngineDeadError, EngineRestartingError, QueueFullError, TooManySequencesError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagedllm.errors import InvalidRequestError

logger = logging.getLogger("pagedllm.entrypoints.openai.errors")


class APIError(Exception):
    """An error the client gets as an OpenAI-style body with this status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> Response:
        return json_response(ErrorResponse(error=self.info), self.status, self.headers)


def to_api_error(exc: BaseException) -> APIError:
    """How an engine-side failure reaches the client: overload and death are 503, bad input 400, bugs 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "server_error", code="server_overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, EngineRestartingError):
        return APIError(503, str(exc), "server_error", code="engine_restarting", headers={"Retry-After": "5"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", code="engine_dead")
    if isinstance(exc, TooManySequencesError):
        return APIError(400, str(exc), param="n", code="too_many_sequences")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    logger.error("request failed", exc_info=exc)
    return APIError(500, "the server failed while serving this request", "server_error")


@contextmanager
def engine_errors() -> Iterator[None]:
    """Raise what the engine raises as the APIError the client should get."""
    try:
        yield
    except Exception as e:
        raise to_api_error(e) from None


def json_response(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status, headers, media_type="application/json")


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400: which field is wrong and why, without echoing the input."""
    messages: list[str] = []
    param = None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        param = param or loc.split(".")[0] or None
        message = f"{loc or 'body'}: {err.get('msg')}"
        if message not in messages:
            messages.append(message)
    return APIError(400, "; ".join(messages) or "invalid request", param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        return exc.response()  # type: ignore[attr-defined]

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        logger.error("unhandled error", exc_info=exc)
        return APIError(500, "internal server error", "server_error").response()

    async def on_validation(_: Request, exc: Exception) -> Response:
        return validation_error(exc).response()  # type: ignore[arg-type]

    async def on_http(_: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return APIError(status, str(getattr(exc, "detail", exc)), kind).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


UTILITY_ROUTES = ("/tokenize", "/detokenize")  # vLLM's "utility endpoints": open unless --api-key-utility-routes


class ApiKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer KEY` (and the `also` paths); /health, /metrics and the rest
    stay open."""

    def __init__(self, app: ASGIApp, api_key: str, also: tuple[str, ...] = ()) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.also = frozenset(also)

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1") or path.rstrip("/") in self.also

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]) and not self._authorized(scope):
            error = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        value = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)
