"""/v1/completions: one or several prompts (text or token ids), n choices each, echo, legacy logprobs; a JSON
response or a stream of events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from json.encoder import encode_basestring

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedllm.engine.protocol import RequestStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.logprobs import completion_logprobs
from pagedllm.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, now
from pagedllm.entrypoints.openai.serving import (
    ChoiceDelta,
    ServerContext,
    client_of,
    finish_fields,
    respond,
    sampling_params,
    server_of,
    sse,
    stream_events,
    submit,
    usage,
)
from pagedllm.outputs import CompletionOutput

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
    params = sampling_params(req, ctx.max_tokens(req.max_tokens), req.logprobs, client_of(raw))
    prompts = await completion_prompts(ctx, req)
    for ids in prompts:
        ctx.check_fits(len(ids), req.max_tokens)
    echoes = [ctx.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    request_id, streams = await submit(ctx, "cmpl", prompts, params, req.n, model)
    events = completion_events(req, request_id, model, prompts, echoes, streams) if req.stream else None

    def body(finals: list[CompletionOutput]) -> CompletionResponse:
        choices = [CompletionChoice(index=i, text=echoes[i // req.n] + c.text, **finish_fields(c),
                                    logprobs=None if req.logprobs is None else completion_logprobs(c, 0, 0))
                   for i, c in enumerate(finals)]
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=usage(prompts, sum(len(c.token_ids) for c in finals)))

    return await respond(raw, streams, req.n, events, body)

def completion_events(req: CompletionRequest, request_id: str, model: str, prompts: list[list[int]],
                      echoes: list[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    """One event per choice delta (the echo before a choice's first text), then the usage if asked for."""
    created = now()
    text_offsets = [0] * (len(streams) * req.n)
    chunks = TextChunks(request_id, created, model)

    def event(d: ChoiceDelta) -> str:
        text = echoes[d.index // req.n] + d.text if d.first else d.text
        if req.logprobs is None:
            return chunks.text(d.index, text, d.output.finish_reason, d.output.stop_reason)
        logprobs = completion_logprobs(d.output, d.first_token, text_offsets[d.index])
        text_offsets[d.index] += sum(len(t) for t in logprobs.tokens)
        choice = CompletionChoice(index=d.index, text=text, logprobs=logprobs, **finish_fields(d.output))
        return sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice]))

    def last(completion_tokens: int) -> str | None:
        if not (req.stream_options and req.stream_options.include_usage):
            return None
        return sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                      usage=usage(prompts, completion_tokens)))

    return stream_events(streams, len(text_offsets), req.logprobs is not None, event, last)


NO_FINISH = 'null,"stop_reason":null'


def json_value(value: int | str | None) -> str:
    """A finish or stop reason as pydantic writes it (non-ASCII text as is)."""
    return "null" if value is None else encode_basestring(value) if isinstance(value, str) else json.dumps(value)


class TextChunks:
    """A stream's events without logprobs, the same bytes as sse(CompletionResponse(...)): the response's fields
    serialized once, each event's text and finish joined in. The event loop builds one per streamed token, and the
    two pydantic models plus their serialization were a tenth of its time serving 64 streams."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        empty = CompletionResponse(id=request_id, created=created, model=model, choices=[]).model_dump_json()
        head, self.tail = empty.split('"choices":[]')
        self.head = f'data: {head}"choices":[{{"index":'

    def text(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        finish = NO_FINISH if finish_reason is None and stop_reason is None else \
            f'{json_value(finish_reason)},"stop_reason":{json_value(stop_reason)}'
        choice = f'{index},"text":{encode_basestring(text)},"logprobs":null,"finish_reason":{finish}'
        return f"{self.head}{choice}}}]{self.tail}\n\n"
