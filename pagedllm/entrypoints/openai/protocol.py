"""The OpenAI HTTP schema the server speaks, as pydantic models (with vLLM's extra sampling fields).

Requests ignore unknown fields (as OpenAI and vLLM do) but reject wrong types; responses carry exactly the
fields the official `openai` client reads, plus vLLM's `stop_reason`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_serializer, model_validator

from pagedllm.sampling_params import SEED_RANGE

# The ranges every request field is checked against at the door (the OpenAPI schema shows them too).
MAX_N = 128  # choices per request
MAX_STOP = 32  # stop strings (each scanned after every token)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 256  # prompts of one batched /v1/completions request
MAX_MESSAGES = 2048  # as OpenAI
MAX_CONTENT_PARTS = 256
MAX_LOGIT_BIAS = 300  # as OpenAI (the server refuses logit_bias, after this cheap check)
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1
# Numbers in requests are strict: JSON true is not 1 (`max_tokens: true`, `prompt: [true, false]`), nor "2" two.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # an int is still a float
TokenId = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- errors ----------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests --------------------------------------------------------------------------------------------
def lone_surrogate(value: Any) -> bool:
    """Whether a string in `value` (strings, lists and dicts of them, however deep) holds half of a UTF-16 pair:
    JSON can carry one ("\\ud800"), no tokenizer or UTF-8 response can. Lists of numbers are not walked."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, list) and item and not isinstance(item[0], (int, float)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, BaseModel):  # nested request parts: structured_outputs, tools, response_format
            stack.extend(item.__dict__.values())
            stack.extend((item.model_extra or {}).values())
    return False


def too_long(value: Any, limit: int) -> bool:
    return isinstance(value, list) and len(value) > limit


class RequestModel(BaseModel):
    """A request body: unknown fields ignored (as OpenAI and vLLM), no NaN or infinity, only valid Unicode."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="after")
    def _valid_unicode(self) -> RequestModel:
        for name, value in [*self.__dict__.items(), *(self.model_extra or {}).items()]:
            if lone_surrogate(value):
                raise ValueError(f"{name} is not valid Unicode (a lone UTF-16 surrogate)")
        return self


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extra field; an unknown key is refused rather than silently unconstrained."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class SamplingRequest(RequestModel):
    """Fields both endpoints share: OpenAI's sampling fields, then vLLM's extras."""

    model: str | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: Float | None = Field(None, ge=0, le=100)
    top_p: Float | None = Field(None, gt=0, le=1)
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    seed: Int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None  # the client --scheduling-policy fair shares service between (its first 256 characters)
    # vLLM extras
    priority: Int = Field(0, ge=-INT32_MAX, le=INT32_MAX)  # lower runs first under --scheduling-policy priority
    top_k: Int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: Float = Field(0.0, ge=0, le=1)
    repetition_penalty: Float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _short_stop_strings(self) -> SamplingRequest:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return self


class CompletionRequest(SamplingRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]

    @model_validator(mode="before")
    @classmethod
    def _few_prompts(cls, data: Any) -> Any:
        """Count a batch of prompts before validating them (that costs time in proportion)."""
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if too_long(prompt, MAX_PROMPTS) and not isinstance(prompt[0], int):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return data
    max_tokens: Int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TextPart(RequestModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    """A message of the conversation; extra keys (tool calls, names) go to the chat template untouched. As in
    OpenAI's API, every message has content except an assistant's that calls tools."""

    model_config = ConfigDict(extra="allow")

    role: ChatRole
    content: str | list[TextPart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _few_parts(cls, data: Any) -> Any:
        if isinstance(data, dict) and too_long(data.get("content"), MAX_CONTENT_PARTS):
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts per message")
        return data

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        calls = (self.model_extra or {}).get("tool_calls") or (self.model_extra or {}).get("function_call")
        if self.content is None and not (self.role == "assistant" and calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)

    @model_validator(mode="before")
    @classmethod
    def _few_messages(cls, data: Any) -> Any:
        """Count the messages before validating them (that costs time in proportion)."""
        if isinstance(data, dict) and too_long(data.get("messages"), MAX_MESSAGES):
            raise ValueError(f"at most {MAX_MESSAGES} messages per request")
        return data
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: Int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: Int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses -------------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:  # OpenAI sends {"content": "..."} without a null role
        out: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.tool_calls is not None:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        return out


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
