"""/v1/messages, Anthropic's Messages API: system, messages of text, tool_use and tool_result blocks, tools and
tool_choice, stop_sequences, a message or Anthropic's event stream. The request converts into one chat request and
runs on the chat path (chat_path.py); /v1/messages/count_tokens renders it without running it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai import chat_path
from pagedllm.entrypoints.openai.chat_path import ChatRun, stop_sequence
from pagedllm.entrypoints.openai.errors import APIError, json_response, to_api_error
from pagedllm.entrypoints.openai.protocol_messages import (
    AnthropicMessage,
    AnthropicToolChoice,
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    StreamEvent,
    TextBlock,
    TextOut,
    ToolUseOut,
)
from pagedllm.entrypoints.openai.serving import (
    ChoiceDelta,
    SSEResponse,
    client_of,
    server_of,
    sse_event,
    stream_events,
)
from pagedllm.entrypoints.openai.serving_chat import render_chat
from pagedllm.entrypoints.openai.tool_calls import ToolCall, strict_json
from pagedllm.outputs import CompletionOutput

router = APIRouter()


# ---- request -> chat request -----------------------------------------------------------------------------
def text_of(content: str | list[TextBlock] | None) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content or [])


def chat_messages(m: AnthropicMessage, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool_result blocks become tool messages (before its text),
    an assistant's tool_use blocks its tool calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if block.type == "text":
            if block.text is None:
                raise APIError(400, f"{where}.text: a text block needs text", param=where)
            texts.append(block.text)
        elif block.type == "tool_use" and m.role == "assistant":
            if not block.id or not block.name or block.input is None:
                raise APIError(400, f"{where}: a tool_use block needs id, name and input", param=where)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif block.type == "tool_result" and m.role == "user":
            if not block.tool_use_id:
                raise APIError(400, f"{where}.tool_use_id: a tool_result block needs tool_use_id", param=where)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text_of(block.content)})
        else:
            raise APIError(400, f"{where}.type: a {m.role} message cannot hold a {block.type} block", param=where)
    message: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return results + ([message] if texts or calls or not results else [])


def tool_fields(tools: list | None, choice: AnthropicToolChoice | None) -> dict[str, Any]:
    """Anthropic's tools and tool_choice as chat's: auto, any (= required), tool (= named), none."""
    if not tools:
        return {}
    fields: dict[str, Any] = {"tools": [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in tools]}
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice.name: a tool choice of type tool names the tool", param="tool_choice")
        fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                 else {"any": "required"}.get(choice.type, choice.type))
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def conversation(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The messages and tools of a request in chat's form."""
    messages = [{"role": "system", "content": text_of(req.system)}] if req.system else []
    for i, m in enumerate(req.messages):
        messages.extend(chat_messages(m, i))
    return {"model": req.model, "messages": messages, **tool_fields(req.tools, req.tool_choice)}


def chat_fields(req: MessagesRequest) -> dict[str, Any]:
    sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences}
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        sampling["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                             "schema": fmt.json_schema}}
    return {**conversation(req), "max_tokens": req.max_tokens, "stream": req.stream,
            **{k: v for k, v in sampling.items() if v is not None}}


# ---- chat output -> message ------------------------------------------------------------------------------
def stop_reason(c: CompletionOutput, calls: bool) -> str | None:
    if c.finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence(c) is not None else "end_turn"


def tool_use(call: ToolCall) -> ToolUseOut:
    arguments = strict_json(call.arguments)
    return ToolUseOut(id=call.id, name=call.name, input=arguments if isinstance(arguments, dict) else {})


def message_body(run: ChatRun, c: CompletionOutput) -> MessageResponse:
    text, calls = chat_path.split_output(c, run.tools)
    content: list[TextOut | ToolUseOut] = [TextOut(text=text)] if text or not calls else []
    content += [tool_use(call) for call in calls]
    return MessageResponse(id=run.request_id, model=run.model, content=content,
                           stop_reason=stop_reason(c, bool(calls)), stop_sequence=stop_sequence(c),
                           usage=AnthropicUsage(input_tokens=len(run.prompt), output_tokens=len(c.token_ids)))


# ---- the endpoints ---------------------------------------------------------------------------------------
@router.post("/v1/messages")
async def create_message(req: MessagesRequest, raw: Request) -> Response:
    ctx = server_of(raw)
    run = await chat_path.start_chat(ctx, chat_path.chat_request(chat_fields(req)), "msg", client_of(raw))
    if req.stream:
        return SSEResponse(MessageEvents(run).events(), run.streams, ctx.stream_send_timeout)
    final = await chat_path.final_output(raw, run)
    return final if isinstance(final, Response) else json_response(message_body(run, final))


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, raw: Request) -> Response:
    ctx = server_of(raw)
    chat = chat_path.chat_request(conversation(req))
    ctx.check_model(chat.model)
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or []] if chat.tool_choice != "none" else None
    prompt = await render_chat(ctx, chat.messages, True, tools)
    return json_response(CountTokensResponse(input_tokens=len(prompt)))


# ---- streaming -------------------------------------------------------------------------------------------
def event(kind: str, **fields: Any) -> str:
    return sse_event(kind, StreamEvent(type=kind, **fields))


def sse_error(exc: Exception) -> str:
    return sse_event("error", to_api_error(exc).anthropic_body())


class MessageEvents:
    """Anthropic's event stream of one run: message_start, then each content block (text as text_delta, a tool call
    once complete as one input_json_delta) between its start and stop, then message_delta (stop reason, usage) and
    message_stop."""

    def __init__(self, run: ChatRun) -> None:
        self.run = run
        self.splitter = chat_path.OutputSplitter(run.tools)
        self.blocks = 0  # content blocks started
        self.text_open = False
        self.calls = False
        self.final: CompletionOutput | None = None

    def events(self) -> AsyncIterator[str]:
        message = MessageResponse(id=self.run.request_id, model=self.run.model, content=[],
                                  usage=AnthropicUsage(input_tokens=len(self.run.prompt), output_tokens=0))
        return stream_events(self.run.streams, 1, False, self.on_delta, self.on_end,
                             first=[event("message_start", message=message.model_dump())], error=sse_error, done=None)

    def on_delta(self, d: ChoiceDelta) -> str | None:
        if d.output.finish_reason is not None:
            self.final = d.output
        text, calls = self.splitter.update(d)
        out = []
        if text:
            if not self.text_open:
                out.append(self.start_block({"type": "text", "text": ""}))
                self.text_open = True
            out.append(event("content_block_delta", index=self.blocks - 1,
                             delta={"type": "text_delta", "text": text}))
        for call in calls:
            self.calls = True
            out.append(self.close_text())
            out.append(self.start_block({"type": "tool_use", "id": call.id, "name": call.name, "input": {}}))
            out.append(event("content_block_delta", index=self.blocks - 1,
                             delta={"type": "input_json_delta", "partial_json": call.arguments}))
            out.append(event("content_block_stop", index=self.blocks - 1))
        return "".join(out) or None

    def start_block(self, block: dict[str, Any]) -> str:
        self.blocks += 1
        return event("content_block_start", index=self.blocks - 1, content_block=block)

    def close_text(self) -> str:
        if not self.text_open:
            return ""
        self.text_open = False
        return event("content_block_stop", index=self.blocks - 1)

    def on_end(self, completion_tokens: int) -> str:
        c = self.final
        out = [self.close_text()]
        reason = None if c is None else stop_reason(c, self.calls)
        out.append(event("message_delta", delta={"stop_reason": reason, "stop_sequence": c and stop_sequence(c)},
                         usage={"output_tokens": completion_tokens}))
        out.append(event("message_stop"))
        return "".join(out)
