"""How failures reach a client: every bad request is a 4xx with an OpenAI-style body
{"error": {message, type, param, code}} (Anthropic's {"type": "error", "error": {type, message}} on /v1/messages),
never a 500; overload and a dead or restarting engine are 503s; and the API key that guards /v1."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.engine.protocol import EngineDeadError, EngineRestartingError, QueueFullError, TooManySequencesError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagedllm.entrypoints.openai.protocol_messages import AnthropicErrorInfo, AnthropicErrorResponse
from pagedllm.errors import InvalidRequestError

logger = logging.getLogger("pagedllm.entrypoints.openai.errors")
ANTHROPIC_PATH = "/v1/messages"  # the routes whose clients read Anthropic's error body
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


class APIError(Exception):
    """An error the client gets as an OpenAI-style body with this status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self, path: str = "") -> Response:
        """The error body the client of `path` reads: Anthropic's on /v1/messages, OpenAI's elsewhere."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATH) else ErrorResponse(error=self.info)
        return json_response(body, self.status, self.headers)

    def anthropic_body(self) -> AnthropicErrorResponse:
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=self.info.message))


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


UNION_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none"}  # pydantic's names for a union's members


def field_path(loc: tuple) -> tuple:
    """An error's location as the client wrote the request: no "body", no union member names ("str", "list[...]")."""
    return tuple(x for x in loc if x != "body" and not (isinstance(x, str) and (x in UNION_BRANCHES or "[" in x)))


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400: which field is wrong and why, without echoing the input. Of a union's
    members, the errors of the one the input went deepest into (a list of blocks, not "should be a string")."""
    errors = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
        errors.append((field_path(tuple(err.get("loc", ()))), err.get("msg")))
    messages: list[str] = []
    for path, msg in errors:
        if any(len(other) > len(path) and other[:len(path)] == path for other, _ in errors):
            continue
        message = f"{'.'.join(map(str, path)) or 'body'}: {msg}"
        if message not in messages:
            messages.append(message)
    param = next((str(path[0]) for path, _ in errors if path), None)
    return APIError(400, "; ".join(messages) or "invalid request", param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        return exc.response(request.url.path)  # type: ignore[attr-defined]

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.error("unhandled error", exc_info=exc)
        return APIError(500, "internal server error", "server_error").response(request.url.path)

    async def on_validation(request: Request, exc: Exception) -> Response:
        return validation_error(exc).response(request.url.path)  # type: ignore[arg-type]

    async def on_http(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return APIError(status, str(getattr(exc, "detail", exc)), kind).response(request.url.path)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


UTILITY_ROUTES = ("/tokenize", "/detokenize")  # vLLM's "utility endpoints": open unless --api-key-utility-routes


class ApiKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY` (and the `also` paths), KEY
    one of the server's keys; /health, /metrics and the rest stay open. With several keys, the key a request came
    with names its client (`key_client`, a hash: the key itself is never shown), in the request's scope state."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str], also: tuple[str, ...] = ()) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self.expected = [k.encode() for k in keys]
        self.names = [key_client(k) for k in keys] if len(keys) > 1 else [None] * len(keys)
        self.also = frozenset(also)

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1") or path.rstrip("/") in self.also

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            index = self._key_index(scope)
            if index is None:
                error = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response(scope["path"])(scope, receive, send)
                return
            if self.names[index] is not None:
                scope.setdefault("state", {})[KEY_CLIENT_STATE] = self.names[index]
        await self.app(scope, receive, send)

    def _key_index(self, scope: Scope) -> int | None:
        """Which key the request sent (every key compared, in constant time each), or None."""
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        sent = [headers.get(b"x-api-key", b"").strip()]
        if scheme.lower() == b"bearer":
            sent.append(token.strip())
        matches = [i for i, expected in enumerate(self.expected) if any(hmac.compare_digest(s, expected) for s in sent)]
        return matches[0] if matches else None


KEY_CLIENT_STATE = "pagedllm_key_client"  # the scope state's entry for the client an API key names


def key_client(api_key: str) -> str:
    """The client name of an API key: "key-" and the first 8 hex digits of its SHA-256 (metrics and logs may show
    it; --client-weights may weigh it)."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:8]
