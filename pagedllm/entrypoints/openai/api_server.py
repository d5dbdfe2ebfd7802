"""OpenAI-compatible HTTP server (`pagedllm serve`): /v1/completions, /v1/chat/completions, /v1/models, and
vLLM's /health, /metrics, /tokenize, /detokenize, /version, over the AsyncLLMEngine.

Every bad request is a 4xx with an OpenAI-style body {"error": {message, type, param, code}}, never a 500;
a client that goes away aborts its requests; past --max-waiting-requests new requests get 503 + Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import hmac
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineRestartingError,
    QueueFullError,
    RequestStream,
    build_serving_engine,
)
from pagedllm.engine.router import DEFAULT_ROUTING_MARGIN, ROUTING_POLICIES
from pagedllm.entrypoints.openai import dashboard
from pagedllm.entrypoints.openai.limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_STREAM_SEND_TIMEOUT,
    OFF_LOOP_CHARS,
    OFF_LOOP_TOKENS,
    RequestLimitMiddleware,
    SendDeadline,
    WorkerPool,
)
from pagedllm.entrypoints.openai.metrics import EngineStats, ReplicaSetStats
from pagedllm.entrypoints.openai.protocol import (
    MAX_N,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    TopLogprob,
    UsageInfo,
    now,
    random_id,
)
from pagedllm.entrypoints.openai.response_format import structured_outputs_of, tool_names
from pagedllm.entrypoints.openai.tool_calls import (
    ToolCallStream,
    parse_tool_calls,
    render_tool_messages,
    template_knows_tools,
)
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")
T = TypeVar("T")
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


# ---- errors ----------------------------------------------------------------------------------------------
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
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    logger.error("request failed", exc_info=exc)
    return APIError(500, "the server failed while serving this request", "server_error")


@contextmanager
def engine_errors() -> Iterator[None]:
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


class ApiKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer KEY`; /health, /metrics and the rest stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            error = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        value = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


# ---- the server's state ----------------------------------------------------------------------------------
@dataclass
class ServerContext:
    engine: AsyncLLMEngine
    stats: EngineStats
    model_names: list[str]
    model_path: str | None
    workers: WorkerPool = dataclasses.field(default_factory=WorkerPool)
    stream_send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return name or self.model_names[0]

    async def tokenize(self, prompt: str | list[int], param: str) -> list[int]:
        """Token ids checked against vocabulary and context (read-only engine use: safe off its thread); a long
        prompt in a worker thread, so the event loop goes on serving."""
        try:
            if len(prompt) > (OFF_LOOP_CHARS if isinstance(prompt, str) else OFF_LOOP_TOKENS):
                return await self.workers.run(self.engine.tokenize_prompt, prompt)
            return self.engine.tokenize_prompt(prompt)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=param) from None
        except EngineRestartingError as e:
            raise to_api_error(e) from None

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse a text no context could hold before tokenizing it (that costs time in proportion)."""
        limit = self.engine.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"the {param} have {len(text)} characters: more than max_model_len "
                           f"({self.max_model_len}) tokens can hold", param=param, code="context_length_exceeded")

    def check_fits(self, prompt_len: int, max_tokens: int | None) -> None:
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.",
                param="max_tokens", code="context_length_exceeded")


def server_of(request: Request) -> ServerContext:
    return request.app.state.server


# ---- requests -> engine ----------------------------------------------------------------------------------
def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for one choice; absurd values are 400s naming the field."""
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, max_tokens=max_tokens,
            min_tokens=req.min_tokens, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, structured_outputs=structured_outputs_of(req))
    except InvalidRequestError as e:
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=field if field in type(req).model_fields else None) from None


async def compile_grammar(engine: AsyncLLMEngine, params: SamplingParams) -> None:
    """Compile a structured-output request's grammar before it is queued, in a worker thread: a big schema stalls
    neither the event loop nor the engine's steps, and a grammar the compiler refuses is a 400."""
    compile_ahead = getattr(engine, "compile_grammar", None)  # replicas compile when the request reaches them
    if params.structured_outputs is not None and compile_ahead is not None:
        with engine_errors():
            await compile_ahead(params.structured_outputs)


def submit_choices(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                   n: int) -> list[RequestStream]:
    """One engine request per prompt, sampling n choices in parallel over the prompt's shared KV blocks;
    choice index = prompt * n + sample (sample i of a seeded request draws from seed + i)."""
    engine.check_admission()
    streams: list[RequestStream] = []
    try:
        for p, ids in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{p}"
            streams.append(engine.add_request(sub_id, ids, dataclasses.replace(params, n=n)))
    except BaseException:
        cancel_all(streams)
        raise
    return streams


def cancel_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.cancel()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they arrive, tagged with the request's position in `streams`."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def merge_choices(streams: list[RequestStream]) -> AsyncIterator[tuple[int, CompletionOutput]]:
    """Each choice's completion whenever it moved (tokens, text or finish); choice index = stream * n + sample."""
    seen: dict[int, tuple[int, int, str | None]] = {}
    async for p, out in merge_streams(streams):
        for c in out.outputs:
            i, state = p * len(out.outputs) + c.index, (len(c.token_ids), len(c.text), c.finish_reason)
            if seen.get(i) != state:
                seen[i] = state
                yield i, c


async def collect(streams: list[RequestStream], n: int) -> list[CompletionOutput]:
    """The final output of every choice, in choice order."""
    finals: list[CompletionOutput | None] = [None] * (len(streams) * n)
    for stream in streams:
        stream.allow_restart()  # a restarted request's outputs start over; only the final ones count here
    with engine_errors():
        async for i, c in merge_choices(streams):
            finals[i] = c
    return [f for f in finals if f is not None]


async def collect_unless_disconnected(raw: Request, streams: list[RequestStream],
                                     n: int) -> list[CompletionOutput] | None:
    """Every choice's final output, or None when the client left first (its requests are aborted either way)."""
    try:
        return await unless_disconnected(raw, collect(streams, n))
    finally:
        cancel_all(streams)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` unless the client hangs up first; then cancel it (aborting its requests), return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """An event stream that aborts its requests however it ends: client gone (before the first chunk too), or a
    client that stopped reading for `send_timeout` seconds (its unread output is not kept, see RequestStream)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream],
                 send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.streams = streams
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deadline = SendDeadline(send, self.send_timeout)
        try:
            await super().__call__(scope, receive, deadline.send)
        except asyncio.CancelledError:
            if not deadline.expired:
                raise
            asyncio.current_task().uncancel()  # our own timer's cancellation, handled here
            logger.warning("aborting a stream: the client read nothing for %g s", self.send_timeout)
        finally:
            deadline.close()
            cancel_all(self.streams)


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_error(exc: Exception) -> str:
    """A failure after the stream began: an error event (the openai client raises it), then [DONE]."""
    return sse(ErrorResponse(error=to_api_error(exc).info))


def usage(prompts: list[list[int]], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def finish_fields(c: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


# ---- logprobs --------------------------------------------------------------------------------------------
def clamp(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def token_text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def by_rank(entry: dict[int, Logprob]) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else math.inf)


def completion_logprobs(c: CompletionOutput, start: int, text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy format for tokens `start:` of the output; top_logprobs: the top-k and the chosen."""
    out = CompletionLogprobs()
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=True):
        chosen = entry[token]
        out.tokens.append(token_text(chosen))
        out.token_logprobs.append(clamp(chosen.logprob))
        out.top_logprobs.append({token_text(lp): clamp(lp.logprob) for lp in by_rank(entry)})
        out.text_offset.append(text_offset)
        text_offset += len(token_text(chosen))
    return out


def top_logprob(lp: Logprob) -> TopLogprob:
    return TopLogprob(token=token_text(lp), logprob=clamp(lp.logprob), bytes=list(token_text(lp).encode()))


def chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> ChatLogprobs:
    """OpenAI's chat format: per token its logprob and bytes, and the top_n alternatives by rank."""
    content = []
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=True):
        tops = [top_logprob(lp) for lp in by_rank(entry)[:top_n]]
        content.append(ChatLogprobEntry(**top_logprob(entry[token]).model_dump(), top_logprobs=tops))
    return ChatLogprobs(content=content)


# ---- /v1/completions -------------------------------------------------------------------------------------
router = APIRouter()


async def completion_prompts(ctx: ServerContext, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str) or not p or isinstance(p[0], int):
        return [await ctx.tokenize(p, "prompt")]  # type: ignore[arg-type]
    return [await ctx.tokenize(x, "prompt") for x in p]  # type: ignore[arg-type]


@router.post("/v1/completions")
async def create_completion(req: CompletionRequest, raw: Request) -> Response:
    ctx = server_of(raw)
    model = ctx.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    params = sampling_params(req, req.max_tokens, req.logprobs)
    prompts = await completion_prompts(ctx, req)
    for ids in prompts:
        ctx.check_fits(len(ids), req.max_tokens)
    echoes = [ctx.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    await compile_grammar(ctx.engine, params)
    request_id = random_id("cmpl")
    with engine_errors():
        streams = submit_choices(ctx.engine, request_id, prompts, params, req.n)
    if req.stream:
        return SSEResponse(completion_events(req, request_id, model, prompts, echoes, streams), streams,
                           ctx.stream_send_timeout)
    finals = await collect_unless_disconnected(raw, streams, req.n)
    if finals is None:
        return Response(status_code=499)
    choices = [CompletionChoice(index=i, text=echoes[i // req.n] + c.text, **finish_fields(c),
                                logprobs=None if req.logprobs is None else completion_logprobs(c, 0, 0))
               for i, c in enumerate(finals)]
    return json_response(CompletionResponse(id=request_id, model=model, choices=choices,
                                            usage=usage(prompts, sum(len(c.token_ids) for c in finals))))


@dataclass
class ChoiceProgress:
    """How much of one choice the stream has sent."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False

    def behind(self, c: CompletionOutput) -> bool:
        return len(c.token_ids) > self.num_tokens


async def completion_events(req: CompletionRequest, request_id: str, model: str, prompts: list[list[int]],
                            echoes: list[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    sent = [ChoiceProgress() for _ in range(len(streams) * req.n)]
    created = now()
    try:
        async for i, c in merge_choices(streams):
            progress = sent[i]
            delta = c.text[progress.text_len:]
            if not (delta or c.finish_reason or (req.logprobs is not None and progress.behind(c))):
                continue
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(c, progress.num_tokens, progress.text_offset)
                progress.text_offset += sum(len(t) for t in logprobs.tokens)
            text = delta if progress.started else echoes[i // req.n] + delta
            progress.text_len, progress.num_tokens, progress.started = len(c.text), len(c.token_ids), True
            choice = CompletionChoice(index=i, text=text, logprobs=logprobs, **finish_fields(c))
            yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice]))
        if req.stream_options and req.stream_options.include_usage:
            total = usage(prompts, sum(p.num_tokens for p in sent))
            yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=total))
    except Exception as e:
        yield sse_error(e)
    finally:
        cancel_all(streams)
    yield "data: [DONE]\n\n"


# ---- /v1/chat/completions --------------------------------------------------------------------------------
def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: content parts joined into one text."""
    d = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        for part in content:
            if part.type != "text":
                raise APIError(400, f"content parts of type {part.type!r} are not supported",
                               param="messages")
        content = "\n".join(part.text or "" for part in content)
    d["content"] = content or ""
    return d


def message_chars(messages: list[ChatMessage]) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or [])
               for m in messages)


async def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The conversation through the model's chat template, as token ids (no second BOS); with `tools`, the tools
    and any tool calls and results in the template's way, or Hermes-style (tool_calls.py). A long one is rendered
    in a worker thread, and one longer than any context refused before it is tokenized."""
    dicts = [message_dict(m) for m in messages]
    dicts, extra = render_tool_messages(dicts, tools, template_knows_tools(ctx.tokenizer.chat_template))

    def render() -> list[int]:
        try:
            text = ctx.tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **extra)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        ctx.check_prompt_chars(text, "messages")
        return ctx.tokenizer.encode(text, add_special_tokens=False)

    return await ctx.workers.run(render) if message_chars(messages) > OFF_LOOP_CHARS else render()


def chat_top_logprobs(req: ChatCompletionRequest) -> int | None:
    """The engine's logprobs setting: None unless logprobs=true; then top_logprobs alternatives (0-20)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


@router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
    ctx = server_of(raw)
    model = ctx.check_model(req.model)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top_n = chat_top_logprobs(req)
    params = sampling_params(req, max_tokens, top_n)
    tools = tool_names(req)
    tool_dicts = [t.model_dump(exclude_none=True) for t in req.tools or []] if tools else None
    prompt = await ctx.tokenize(await render_chat(ctx, req.messages, req.add_generation_prompt, tool_dicts),
                                "messages")
    ctx.check_fits(len(prompt), max_tokens)
    await compile_grammar(ctx.engine, params)
    request_id = random_id("chatcmpl")
    with engine_errors():
        streams = submit_choices(ctx.engine, request_id, [prompt], params, req.n)
    if req.stream:
        return SSEResponse(chat_events(req, request_id, model, prompt, top_n, streams, tools), streams,
                           ctx.stream_send_timeout)
    finals = await collect_unless_disconnected(raw, streams, req.n)
    if finals is None:
        return Response(status_code=499)
    choices = [ChatChoice(index=i, **chat_message(c, tools),
                          logprobs=None if top_n is None else chat_logprobs(c, 0, top_n))
               for i, c in enumerate(finals)]
    return json_response(ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                                usage=usage([prompt], sum(len(c.token_ids) for c in finals))))


def chat_message(c: CompletionOutput, tools: frozenset[str]) -> dict[str, Any]:
    """A choice's message and finish fields: with tools, the calls parsed out of the text (finish_reason
    "tool_calls" when the model ended after writing some)."""
    fields = finish_fields(c)
    if not tools:
        return {"message": ChatResponseMessage(content=c.text), **fields}
    content, calls = parse_tool_calls(c.text, names=tools)
    if calls and c.finish_reason == "stop":
        fields["finish_reason"] = "tool_calls"
    return {"message": ChatResponseMessage(
        content=content.strip() or None,
        tool_calls=[ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                    for call in calls] or None), **fields}


def tool_call_deltas(stream: ToolCallStream, calls: list) -> list[DeltaToolCall]:
    first = len(stream.calls) - len(calls)
    return [DeltaToolCall(index=first + k, id=call.id, type="function",
                          function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
            for k, call in enumerate(calls)]


async def chat_events(req: ChatCompletionRequest, request_id: str, model: str, prompt: list[int],
                      top_n: int | None, streams: list[RequestStream],
                      tools: frozenset[str] = frozenset()) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[ChatStreamChoice], usage_info: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       usage=usage_info))

    sent = [ChoiceProgress() for _ in range(req.n)]
    calls = [ToolCallStream(names=tools) for _ in range(req.n)]
    try:
        for i in range(req.n):  # the role first, as OpenAI does, before any token is ready
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for i, c in merge_choices(streams):
            progress = sent[i]
            delta = c.text[progress.text_len:]
            if not (delta or c.finish_reason or (top_n is not None and progress.behind(c))):
                continue
            logprobs = None if top_n is None else chat_logprobs(c, progress.num_tokens, top_n)
            progress.text_len, progress.num_tokens = len(c.text), len(c.token_ids)
            message, fields = DeltaMessage(content=delta), finish_fields(c)
            if tools:  # content outside the calls as it comes; each call once it is complete
                content, new_calls = calls[i].update(c.text, final=c.finish_reason is not None)
                message = DeltaMessage(content=content or None,
                                       tool_calls=tool_call_deltas(calls[i], new_calls) or None)
                if calls[i].calls and c.finish_reason == "stop":
                    fields["finish_reason"] = "tool_calls"
                if not (content or new_calls or c.finish_reason or logprobs):
                    continue
            yield chunk([ChatStreamChoice(index=i, delta=message, logprobs=logprobs, **fields)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage([prompt], sum(p.num_tokens for p in sent)))
    except Exception as e:
        yield sse_error(e)
    finally:
        cancel_all(streams)
    yield "data: [DONE]\n\n"


# ---- the rest --------------------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(raw: Request) -> Response:
    ctx = server_of(raw)
    cards = [ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
             for name in ctx.model_names]
    return json_response(ModelList(data=cards))


@router.get("/health")
async def health(raw: Request) -> Response:
    """200 while the engine serves (over replicas: while one does; the body then lists each replica); 503 while it
    restarts after a failure, or for good once it is dead."""
    engine = server_of(raw).engine
    if not engine.is_alive:
        with engine_errors():
            engine.check_alive()  # raises the reason
    replicas = getattr(engine, "replica_health", None)
    if replicas is not None:
        return JSONResponse({"status": "ok", "replicas": replicas()})
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(generate_latest(server_of(raw).stats.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request) -> Response:
    ctx = server_of(raw)
    ctx.check_model(req.model)
    tok = ctx.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if req.messages is not None:
        ids = await render_chat(ctx, req.messages, req.add_generation_prompt)
    else:
        ctx.check_prompt_chars(req.prompt, "prompt")
        encode = functools.partial(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        ids = await ctx.workers.run(encode) if len(req.prompt) > OFF_LOOP_CHARS else encode()
    return json_response(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids))


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request) -> Response:
    ctx = server_of(raw)
    ctx.check_model(req.model)
    vocab = ctx.engine.vocab_size
    if len(req.tokens) > ctx.max_model_len:
        raise APIError(400, f"at most max_model_len ({ctx.max_model_len}) tokens", param="tokens")
    if not all(0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return json_response(DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens)))


# ---- app and command -------------------------------------------------------------------------------------
def build_app(engine: Any, model_names: list[str], api_key: str | None = None,
              max_waiting_requests: int = 256, log_interval: float = 5.0,
              model_path: str | None = None, engine_factory: Callable[[], Any] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT,
              stream_send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT, dashboard_rate: float | None = 4.0) -> FastAPI:
    """The FastAPI app over an already loaded LLMEngine; the engine thread lives as long as the app. With an
    `engine_factory` an engine that breaks is replaced by a fresh one (without, it stays down).
    `dashboard_rate`: KV snapshots per second at most for /dashboard (None: no dashboard)."""
    stats = EngineStats(model_names[0], log_interval=log_interval)
    hub = dashboard.DashboardHub(model_names[0], dashboard_rate, hide_prompts=bool(api_key)) if dashboard_rate else None
    observer = stats if hub is None else dashboard.Observers(stats, hub)
    async_engine = AsyncLLMEngine(engine, max_waiting_requests, observer=observer, engine_factory=engine_factory)
    app = build_client_app(async_engine, stats, model_names, api_key, model_path, max_request_bytes=max_request_bytes,
                           body_timeout=body_timeout, stream_send_timeout=stream_send_timeout,
                           on_start=None if hub is None else lambda: hub.start(engine))
    if hub is not None:
        dashboard.mount(app, hub)
    return app


def build_client_app(engine: Any, stats: Any, model_names: list[str], api_key: str | None = None,
                     model_path: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                     body_timeout: float = DEFAULT_BODY_TIMEOUT,
                     stream_send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT,
                     on_start: Callable[[], None] | None = None) -> FastAPI:
    """The app over an engine client (an AsyncLLMEngine, or a ReplicaPool of several), started and shut down with
    the app; `stats.registry` is what /metrics serves; `on_start` runs first (the dashboard's first snapshot)."""
    workers = WorkerPool()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_start is not None:
            on_start()  # before the engine thread owns the engine
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            workers.shutdown()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.server = ServerContext(engine, stats, model_names, model_path, workers, stream_send_timeout)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestLimitMiddleware, max_bytes=max_request_bytes, timeout=body_timeout)
    app.include_router(router)
    return app


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """`pagedllm serve`: the OpenAI-compatible server, with every engine flag."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 "
                                                   "(default: $PAGEDLLM_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: --model as given)")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests queued beyond this get 503 with Retry-After")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413 before they are read")
    g.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help="seconds to receive a whole request body (408 beyond)")
    g.add_argument("--stream-send-timeout", type=float, default=DEFAULT_STREAM_SEND_TIMEOUT,
                   help="a stream whose client reads nothing for this many seconds is aborted")
    g.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open (uvicorn's)")
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic engine throughput line")
    g.add_argument("--no-dashboard", action="store_true", help="no /dashboard (the live view of the KV cache)")
    g.add_argument("--dashboard-rate", type=float, default=4.0,
                   help="/dashboard: KV snapshots per second at most, taken between engine steps")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_data_parallel_args(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    for flag in ("max_waiting_requests", "max_request_bytes", "body_timeout", "stream_send_timeout",
                 "timeout_keep_alive", "data_parallel_size"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    loggers = {"pagedllm.requests": args.disable_log_requests, "pagedllm.stats": args.disable_log_stats}
    for name, disabled in loggers.items():
        logging.getLogger(name).setLevel(logging.WARNING if disabled else logging.INFO)
    if logging.getLogger().level > logging.INFO:  # a server reports its model and KV cache at start
        logging.getLogger("pagedllm").setLevel(logging.INFO)
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY")
    limits = dict(max_request_bytes=args.max_request_bytes, body_timeout=args.body_timeout,
                  stream_send_timeout=args.stream_send_timeout)
    if args.data_parallel_size > 1:
        app = build_data_parallel_app(args, api_key, limits)
    else:
        config = EngineConfig.from_cli_args(args)
        engine = build_serving_engine(config)
        names = args.served_model_name or [args.model or engine.model_name]
        app = build_app(engine, names, api_key=api_key, max_waiting_requests=args.max_waiting_requests,
                        model_path=args.model or engine.model_name, engine_factory=functools.partial(LLMEngine, config),
                        dashboard_rate=None if args.no_dashboard else args.dashboard_rate, **limits)
    dashboard.uvicorn_server(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                             timeout_keep_alive=args.timeout_keep_alive).run()
    return 0


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


def build_data_parallel_app(args: argparse.Namespace, api_key: str | None, limits: dict[str, Any]) -> FastAPI:
    """N replicas behind one endpoint; ray is imported only here."""
    import functools

    from pagedllm.engine.replica_pool import PoolConfig, ReplicaPool

    pool_config = PoolConfig(args.data_parallel_size, args.routing, args.routing_margin,
                             ray_address=args.ray_address, max_waiting_requests=args.max_waiting_requests)
    name = (args.served_model_name or [None])[0]
    observer = functools.partial(EngineStats, name or args.model or "default")
    pool = ReplicaPool(EngineConfig.from_cli_args(args), pool_config, observer_factory=observer)
    names = args.served_model_name or [args.model or pool.model_name]
    return build_client_app(pool, ReplicaSetStats(pool, names[0]), names, api_key, args.model or pool.model_name,
                            **limits)
