"""/v1/chat/completions: the conversation through the model's chat template (with tools, in the template's way or
Hermes-style), n choices, chat logprobs, tool calls parsed out of the text; a JSON response or a stream of events
(the role first, then content deltas, each tool call once it is complete)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedllm.engine.protocol import RequestStream
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import OFF_LOOP_CHARS
from pagedllm.entrypoints.openai.logprobs import chat_logprobs
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    now,
)
from pagedllm.entrypoints.openai.response_format import tool_names
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
from pagedllm.entrypoints.openai.tool_calls import (
    ToolCallStream,
    parse_tool_calls,
    render_tool_messages,
    template_knows_tools,
)
from pagedllm.outputs import CompletionOutput

router = APIRouter()


# ---- the chat template -----------------------------------------------------------------------------------
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
    render = chat_renderer(ctx, messages, add_generation_prompt, tools)
    return await ctx.workers.run(render) if message_chars(messages) > OFF_LOOP_CHARS else render()


def chat_renderer(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                  tools: list[dict[str, Any]] | None = None) -> Callable[[], list[int]]:
    """render_chat's work, to run where the caller says."""
    dicts = [message_dict(m) for m in messages]
    dicts, extra = render_tool_messages(dicts, tools, template_knows_tools(ctx.tokenizer.chat_template))

    def render() -> list[int]:
        try:
            text = ctx.tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **extra)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        ctx.check_prompt_chars(text, "messages")
        return ctx.tokenizer.encode(text, add_special_tokens=False)

    return render


def chat_top_logprobs(req: ChatCompletionRequest) -> int | None:
    """The engine's logprobs setting: None unless logprobs=true; then top_logprobs alternatives (0-20)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


# ---- the endpoint ----------------------------------------------------------------------------------------
@dataclass
class SubmittedChat:
    """A chat request on its way: the model named, the rendered prompt, the offered tools, its streams."""

    model: str
    prompt: list[int]
    tools: frozenset[str]
    request_id: str
    streams: list[RequestStream]


async def submit_chat(ctx: ServerContext, req: ChatCompletionRequest, id_prefix: str, top_n: int | None,
                      n: int, client: str | None = None) -> SubmittedChat:
    """Render, tokenize, check and submit `n` choices of a chat request: every API that speaks in conversations
    (chat completions, Responses, Messages) comes through here."""
    model = ctx.check_model(req.model)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, ctx.max_tokens(max_tokens), top_n, client)
    tools = tool_names(req)
    tool_dicts = [t.model_dump(exclude_none=True) for t in req.tools or []] if tools else None
    prompt = await ctx.tokenize(await render_chat(ctx, req.messages, req.add_generation_prompt, tool_dicts),
                                "messages")
    ctx.check_fits(len(prompt), max_tokens)
    request_id, streams = await submit(ctx, id_prefix, [prompt], params, n, model)
    return SubmittedChat(model, prompt, tools, request_id, streams)


@router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
    ctx = server_of(raw)
    top_n = chat_top_logprobs(req)
    chat = await submit_chat(ctx, req, "chatcmpl", top_n, req.n, client_of(raw))
    model, prompt, tools, request_id, streams = chat.model, chat.prompt, chat.tools, chat.request_id, chat.streams
    events = chat_events(req, request_id, model, prompt, top_n, streams, tools) if req.stream else None

    def body(finals: list[CompletionOutput]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=i, **chat_message(c, tools),
                              logprobs=None if top_n is None else chat_logprobs(c, 0, top_n))
                   for i, c in enumerate(finals)]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage([prompt], sum(len(c.token_ids) for c in finals)))

    return await respond(raw, streams, req.n, events, body)

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


# ---- streaming -------------------------------------------------------------------------------------------
def tool_call_deltas(stream: ToolCallStream, calls: list) -> list[DeltaToolCall]:
    first = len(stream.calls) - len(calls)
    return [DeltaToolCall(index=first + k, id=call.id, type="function",
                          function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
            for k, call in enumerate(calls)]


def chat_events(req: ChatCompletionRequest, request_id: str, model: str, prompt: list[int],
                top_n: int | None, streams: list[RequestStream],
                tools: frozenset[str] = frozenset()) -> AsyncIterator[str]:
    """The role first, as OpenAI does, before any token is ready; then content deltas (with tools: the content
    outside the calls as it comes, each call once it is complete); then the usage if asked for."""
    created = now()
    calls = [ToolCallStream(names=tools) for _ in range(req.n)]

    def chunk(choices: list[ChatStreamChoice], usage_info: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       usage=usage_info))

    def event(d: ChoiceDelta) -> str | None:
        c, i = d.output, d.index
        logprobs = None if top_n is None else chat_logprobs(c, d.first_token, top_n)
        message, fields = DeltaMessage(content=d.text), finish_fields(c)
        if tools:
            content, new_calls = calls[i].update(c.text, final=c.finish_reason is not None)
            message = DeltaMessage(content=content or None, tool_calls=tool_call_deltas(calls[i], new_calls) or None)
            if calls[i].calls and c.finish_reason == "stop":
                fields["finish_reason"] = "tool_calls"
            if not (content or new_calls or c.finish_reason or logprobs):
                return None
        return chunk([ChatStreamChoice(index=i, delta=message, logprobs=logprobs, **fields)])

    def last(completion_tokens: int) -> str | None:
        if not (req.stream_options and req.stream_options.include_usage):
            return None
        return chunk([], usage([prompt], completion_tokens))

    roles = [chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
             for i in range(req.n)]
    return stream_events(streams, req.n, top_n is not None, event, last, first=roles)
