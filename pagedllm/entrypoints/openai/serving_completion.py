"""/v1/completions: one or several prompts (text or token ids), n choices each, echo, legacy logprobs; a JSON
response or a stream of events."""

from __future__ import annotations

from collections.abc import AsyncIterator

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

    def event(d: ChoiceDelta) -> str:
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(d.output, d.first_token, text_offsets[d.index])
            text_offsets[d.index] += sum(len(t) for t in logprobs.tokens)
        text = echoes[d.index // req.n] + d.text if d.first else d.text
        choice = CompletionChoice(index=d.index, text=text, logprobs=logprobs, **finish_fields(d.output))
        return sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice]))

    def last(completion_tokens: int) -> str | None:
        if not (req.stream_options and req.stream_options.include_usage):
            return None
        return sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                      usage=usage(prompts, completion_tokens)))

    return stream_events(streams, len(text_offsets), req.logprobs is not None, event, last)
