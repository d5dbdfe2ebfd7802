"""What every generating endpoint shares: the server's context (engine client, tokenizing, context checks), the
request's SamplingParams, submitting its choices and merging or collecting their outputs, and server-sent events
with the one streaming loop of chat and completions (each choice's new text and tokens as they come)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagedllm.config import ServerConfig
from pagedllm.engine.protocol import EngineClient, EngineRestartingError, RequestStream
from pagedllm.entrypoints.openai.errors import KEY_CLIENT_STATE, APIError, engine_errors, json_response, to_api_error
from pagedllm.entrypoints.openai.limits import (
    OFF_LOOP_CHARS,
    OFF_LOOP_TOKENS,
    DeadlineStreamingResponse,
    WorkerPool,
    utility_pool,
)
from pagedllm.entrypoints.openai.metrics import EngineStats, ReplicaSetStats
from pagedllm.entrypoints.openai.protocol import MAX_N, ErrorResponse, SamplingRequest, UsageInfo, random_id
from pagedllm.entrypoints.openai.response_format import structured_outputs_of
from pagedllm.entrypoints.openai.serving_lora import LoRAModules
from pagedllm.errors import InvalidRequestError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import MAX_CLIENT_CHARS, SamplingParams

if TYPE_CHECKING:
    from pagedllm.model.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm.entrypoints.openai.serving")
CLIENT_HEADER = "x-client-id"  # names the client of the fair policy and the per-client metrics
T = TypeVar("T")


# ---- the server's state ----------------------------------------------------------------------------------
@dataclass
class ServerContext:
    engine: EngineClient
    stats: EngineStats | ReplicaSetStats  # its `registry` is what /metrics serves
    model_names: list[str]
    model_path: str | None
    workers: WorkerPool = dataclasses.field(default_factory=WorkerPool)
    # the open utility routes' tokenizer work: its own thread and a bounded queue, so it cannot delay the above
    utility_workers: WorkerPool = dataclasses.field(default_factory=utility_pool)
    stream_send_timeout: float = ServerConfig.stream_send_timeout
    default_max_tokens: int | None = ServerConfig.default_max_tokens
    loras: LoRAModules | None = None  # the LoRA adapters served as models (made from model_names when None)

    def __post_init__(self) -> None:
        if self.loras is None:
            self.loras = LoRAModules(self.model_names)

    def max_tokens(self, asked: int | None) -> int | None:
        """A request's max_tokens, or the server's --default-max-tokens when it sets none (None: to the context's
        end). Only what the client asked for is checked against the context: the default is a cap, not a claim."""
        return asked if asked is not None else self.default_max_tokens

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> str:
        """The model a request names (the base model's names, or a LoRA adapter's); 404 for any other."""
        if name is not None and name not in self.model_names and self.loras.get(name) is None:
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
def client_of(raw: Request) -> str | None:
    """Who is asking, as the request's metadata says: the client its API key names (with several keys), else its
    X-Client-Id header; None leaves it to the body's `user` field (docs/fairness.md has the order)."""
    named = raw.scope.get("state", {}).get(KEY_CLIENT_STATE)
    return named or raw.headers.get(CLIENT_HEADER) or None


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    client: str | None = None) -> SamplingParams:
    """The engine's SamplingParams for one choice; absurd values are 400s naming the field. `client` (client_of)
    outranks the request's `user`."""
    client = client or req.user
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
            include_stop_str_in_output=req.include_stop_str_in_output, structured_outputs=structured_outputs_of(req),
            priority=req.priority, client=client[:MAX_CLIENT_CHARS] if client is not None else None)
    except InvalidRequestError as e:
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=field if field in type(req).model_fields else None) from None


async def compile_grammar(engine: EngineClient, params: SamplingParams) -> None:
    """Compile a structured-output request's grammar before it is queued, off the event loop: a big schema stalls
    neither the event loop nor the engine's steps, and a grammar the compiler refuses is a 400."""
    if params.structured_outputs is not None:
        with engine_errors():
            await engine.compile_grammar(params.structured_outputs)


async def submit(ctx: ServerContext, id_prefix: str, prompts: list[list[int]], params: SamplingParams,
                 n: int, model: str | None = None) -> tuple[str, list[RequestStream]]:
    """A new request id and the streams of its choices: the grammar compiled first, then admission, then one engine
    request per prompt, on the LoRA adapter `model` names if it names one."""
    await compile_grammar(ctx.engine, params)
    request_id = random_id(id_prefix)
    with engine_errors():
        return request_id, submit_choices(ctx.engine, request_id, prompts, params, n, ctx.loras.get(model))


def submit_choices(engine: EngineClient, request_id: str, prompts: list[list[int]], params: SamplingParams,
                   n: int, lora_request: LoRARequest | None = None) -> list[RequestStream]:
    """One engine request per prompt, sampling n choices in parallel over the prompt's shared KV blocks;
    choice index = prompt * n + sample (sample i of a seeded request draws from seed + i). Admission counts every
    sequence the request adds: prompts x n."""
    engine.check_admission(len(prompts) * n)
    streams: list[RequestStream] = []
    lora = {"lora_request": lora_request} if lora_request is not None else {}
    try:
        for p, ids in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{p}"
            streams.append(engine.add_request(sub_id, ids, dataclasses.replace(params, n=n), **lora))
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


async def respond(raw: Request, streams: list[RequestStream], n: int, events: AsyncIterator[str] | None,
                  body: Callable[[list[CompletionOutput]], BaseModel]) -> Response:
    """The `events` as a stream, or without, the JSON `body` of every choice's final output (499 when the client
    left first)."""
    if events is not None:
        return SSEResponse(events, streams, server_of(raw).stream_send_timeout)
    finals = await collect_unless_disconnected(raw, streams, n)
    if finals is None:
        return Response(status_code=499)
    return json_response(body(finals))


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


def usage(prompts: list[list[int]], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def finish_fields(c: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


# ---- server-sent events ----------------------------------------------------------------------------------
class SSEResponse(DeadlineStreamingResponse):
    """An event stream that aborts its requests however it ends: client gone (before the first chunk too), or a
    client that stopped reading for `send_timeout` seconds (its unread output is not kept, see AsyncRequestStream)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream],
                 send_timeout: float = ServerConfig.stream_send_timeout) -> None:
        super().__init__(content, send_timeout, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.streams = streams

    def closed(self) -> None:
        cancel_all(self.streams)


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_event(name: str, model: BaseModel) -> str:
    """A named event, as the Responses and Messages APIs send them (their clients read the name or the type)."""
    return f"event: {name}\ndata: {model.model_dump_json()}\n\n"


def sse_error(exc: Exception) -> str:
    """A failure after the stream began: an error event (the openai client raises it), then [DONE]."""
    return sse(ErrorResponse(error=to_api_error(exc).info))


@dataclass
class ChoiceProgress:
    """How much of one choice the stream has sent."""

    text_len: int = 0
    num_tokens: int = 0
    started: bool = False


@dataclass
class ChoiceDelta:
    """What one choice has new since its last event: text, and tokens from `first_token` on."""

    index: int
    output: CompletionOutput
    text: str
    first_token: int
    first: bool  # the choice's first event


async def choice_deltas(streams: list[RequestStream], sent: list[ChoiceProgress],
                        logprobs: bool) -> AsyncIterator[ChoiceDelta]:
    """Each choice's new text as it comes (and, with `logprobs`, new tokens even without new text), and its finish."""
    async for i, c in merge_choices(streams):
        progress = sent[i]
        text = c.text[progress.text_len:]
        if not (text or c.finish_reason or (logprobs and len(c.token_ids) > progress.num_tokens)):
            continue
        delta = ChoiceDelta(i, c, text, progress.num_tokens, not progress.started)
        progress.text_len, progress.num_tokens, progress.started = len(c.text), len(c.token_ids), True
        yield delta


async def stream_events(streams: list[RequestStream], num_choices: int, logprobs: bool,
                        event: Callable[[ChoiceDelta], str | None], last: Callable[[int], str | None],
                        first: Iterable[str] = (), error: Callable[[Exception], str] = sse_error,
                        done: str | None = "data: [DONE]\n\n") -> AsyncIterator[str]:
    """The streaming loop of every generating endpoint: the `first` events, then one `event` per choice delta (None:
    nothing to send), then `last(completion tokens)` (the usage, if asked for); a failure as an `error` event; always
    `done` (OpenAI's [DONE]; None for APIs without one); the requests aborted however it ends."""
    sent = [ChoiceProgress() for _ in range(num_choices)]
    try:
        for chunk in first:
            yield chunk
        async for delta in choice_deltas(streams, sent, logprobs):
            chunk = event(delta)
            if chunk is not None:
                yield chunk
        chunk = last(sum(p.num_tokens for p in sent))
        if chunk is not None:
            yield chunk
    except Exception as e:
        yield error(e)
    finally:
        cancel_all(streams)
    if done is not None:
        yield done
