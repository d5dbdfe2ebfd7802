"""The chat-completions engine path for the APIs that convert their requests into a ChatCompletionRequest (OpenAI
Responses, Anthropic Messages): the same template, tools, validation, limits and grammar, one engine request; and
an output split into text and tool calls, whole or as it streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from pagedllm.engine.protocol import RequestStream
from pagedllm.entrypoints.openai.errors import validation_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving import (
    ChoiceDelta,
    ServerContext,
    collect_unless_disconnected,
)
from pagedllm.entrypoints.openai.serving_chat import chat_message, submit_chat
from pagedllm.entrypoints.openai.tool_calls import ToolCall, ToolCallStream
from pagedllm.outputs import CompletionOutput


@dataclass
class ChatRun:
    """A converted request on its way through the engine: what its endpoint needs to shape the output."""

    request: ChatCompletionRequest
    model: str
    prompt: list[int]
    tools: frozenset[str]  # the functions whose calls are returned as calls
    request_id: str
    streams: list[RequestStream]


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request an endpoint's request converts into; what chat's schema refuses is a 400 naming the field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from None  # type: ignore[arg-type]


async def start_chat(ctx: ServerContext, req: ChatCompletionRequest, id_prefix: str,
                     client: str | None = None) -> ChatRun:
    """Render, tokenize, check and submit one choice of `req`, exactly as /v1/chat/completions does."""
    chat = await submit_chat(ctx, req, id_prefix, None, 1, client)
    return ChatRun(req, chat.model, chat.prompt, chat.tools, chat.request_id, chat.streams)


async def final_output(raw: Request, run: ChatRun) -> CompletionOutput | Response:
    """The run's final output, or a 499 when the client left first (its request aborted)."""
    finals = await collect_unless_disconnected(raw, run.streams, 1)
    return Response(status_code=499) if finals is None else finals[0]


def split_output(c: CompletionOutput, tools: frozenset[str]) -> tuple[str, list[ToolCall]]:
    """The final text outside tool calls, and the calls, as chat completions returns them."""
    fields = chat_message(c, tools)
    message = fields["message"]
    calls = [ToolCall(call.function.name, call.function.arguments, id=call.id) for call in message.tool_calls or []]
    return message.content or "", calls


@dataclass
class OutputSplitter:
    """A streamed choice's new text outside calls and its newly complete calls, delta by delta."""

    tools: frozenset[str]
    calls: ToolCallStream = field(init=False)

    def __post_init__(self) -> None:
        self.calls = ToolCallStream(names=self.tools)

    def update(self, d: ChoiceDelta) -> tuple[str, list[ToolCall]]:
        if not self.tools:
            return d.text, []
        return self.calls.update(d.output.text, final=d.output.finish_reason is not None)


def stop_sequence(c: CompletionOutput) -> str | None:
    """The stop string that ended the output, if one did."""
    return c.stop_reason if isinstance(c.stop_reason, str) else None
