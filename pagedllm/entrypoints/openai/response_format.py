"""What a request asks its output to be, as one StructuredOutputsParams for the engine: OpenAI's `response_format`,
vLLM's `structured_outputs` (or its older `guided_*` fields), or a tool call forced by `tool_choice`. At most one of
them: two constraints on one output are the client's error, not something to merge."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest
from pagedllm.entrypoints.openai.tool_calls import MAX_PARALLEL_CALLS, forced_tools, tool_call_grammar
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams


def structured_outputs_of(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, or None for free text; conflicting or malformed ones raise
    InvalidRequestError."""
    found: dict[str, StructuredOutputsParams] = {}
    if req.response_format is not None and req.response_format.type != "text":
        found["response_format"] = _from_response_format(req)
    if req.structured_outputs is not None:
        found["structured_outputs"] = _checked(
            "structured_outputs", **req.structured_outputs.model_dump(by_alias=True, exclude_defaults=True))
    guided = {k: v for k, v in (("json", req.guided_json), ("regex", req.guided_regex),
                                ("choice", req.guided_choice), ("grammar", req.guided_grammar)) if v is not None}
    if guided:
        found["guided_*"] = _checked("guided_*", **guided, whitespace_pattern=req.guided_whitespace_pattern)
    if isinstance(req, ChatCompletionRequest):
        tools = _forced_tool_call(req)
        if tools is not None:
            found["tool_choice"] = tools
    if len(found) > 1:
        raise InvalidRequestError(f"give at most one of {' and '.join(found)}: each constrains the whole output")
    return next(iter(found.values()), None)


def _from_response_format(req: SamplingRequest) -> StructuredOutputsParams:
    fmt = req.response_format
    assert fmt is not None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise InvalidRequestError("response_format json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def _checked(name: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{name}: {e}") from None


def _forced_tool_call(req: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """A grammar of `<tool_call>` blocks when tool_choice is "required" (one or more calls, up to
    MAX_PARALLEL_CALLS unless parallel_tool_calls is false) or names a function (exactly one call, as vLLM); None
    otherwise."""
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise InvalidRequestError("tool_choice needs tools")
    if choice is None or choice in ("none", "auto"):
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    chosen = forced_tools(tools, choice if isinstance(choice, str) else choice.model_dump())
    several = choice == "required" and req.parallel_tool_calls is not False
    return StructuredOutputsParams(grammar=tool_call_grammar(chosen, MAX_PARALLEL_CALLS if several else 1))


def tool_mode(req: ChatCompletionRequest) -> str:
    """How the server treats tools: "none" (no tools in the prompt, no parsing), "auto" (tools in the prompt, calls
    parsed from free text) or "forced" (a grammar writes the calls); OpenAI's default is "auto" when tools are
    given."""
    if not req.tools or req.tool_choice == "none":
        return "none"
    return "auto" if req.tool_choice in (None, "auto") else "forced"


def tool_names(req: ChatCompletionRequest) -> frozenset[str]:
    """The functions whose calls the server returns as tool calls: those in `tools`, none when tools are off (a
    call of any other function stays in the content: the client has nothing to run for it)."""
    return frozenset(t.function.name for t in req.tools or []) if tool_mode(req) != "none" else frozenset()
