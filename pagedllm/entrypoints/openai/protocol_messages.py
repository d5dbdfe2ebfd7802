"""Anthropic's Messages API as pydantic models: the request /v1/messages takes, the message, stream events and error
body it sends back (the fields the official `anthropic` client reads)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import (
    INT32_MAX,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_STOP,
    Float,
    Int,
    RequestModel,
)


# ---- requests --------------------------------------------------------------------------------------------
class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ContentBlock(RequestModel):
    """A block of a message: text, a tool_use the assistant wrote, or a tool_result the user sends back."""

    type: Literal["text", "tool_use", "tool_result"]
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[TextBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(max_length=MAX_CONTENT_PARTS)]


class AnthropicTool(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    format: JsonOutputFormat | None = None  # structured outputs: the text is JSON matching the schema


class MessagesRequest(RequestModel):
    model: str | None = None
    max_tokens: Int = Field(ge=1, le=INT32_MAX)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    stream: bool = False
    temperature: Float | None = Field(None, ge=0, le=100)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, le=INT32_MAX)
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(RequestModel):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


# ---- responses -------------------------------------------------------------------------------------------
class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class StreamEvent(BaseModel):
    """One event of a stream: `type` plus the fields of that type (message, index, content_block, delta, usage)."""

    model_config = ConfigDict(extra="allow")

    type: str


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
