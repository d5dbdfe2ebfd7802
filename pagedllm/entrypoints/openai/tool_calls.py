"""Tool calling in the Hermes / Qwen format: tools rendered into the prompt, `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks forced by a grammar (tool_choice "required" or a named function) or parsed out of free
text ("auto"), whole or while streaming.

Chat templates without a tools section (SmolLM2's) get the tools as a Hermes-style system section, assistant tool
calls as `<tool_call>` blocks and tool results as `<tool_response>` blocks in a user turn, as Qwen2.5's template
writes them; a template that knows tools gets them as its `tools` variable.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.grammar_limits import check_schema
from pagedllm.engine.structured_output import close_objects
from pagedllm.errors import InvalidRequestError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 4  # "required" allows 1..4 calls (1 with parallel_tool_calls=false); a named function is 1 call
# The layout json.dumps writes and Hermes models emit; flexible whitespace before "{" of an alternative %json rule
# was accepted by llguidance in tests, so tool-call JSON has none.
CALL_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (OpenAI sends them as a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


# ---- the prompt ------------------------------------------------------------------------------------------
def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         template_has_tools: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables for a conversation with tools: as they are plus `tools=` for a
    template that renders tools itself; otherwise Hermes-style text in plain system / assistant / user turns."""
    messages = [_arguments_as_objects(m) for m in messages]
    if template_has_tools:
        return messages, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [f"{CALL_OPEN}\n{json.dumps(_call_object(c), ensure_ascii=False)}\n{CALL_CLOSE}"
                      for c in m["tool_calls"]]
            out.append({**m, "content": "\n".join([m["content"]] * bool(m.get("content")) + blocks)})
        else:
            out.append(m)
    if tools:
        section = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, {}


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Assistant tool calls with their JSON-text arguments parsed, as templates (and vLLM) expect them."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            parsed = strict_json(function["arguments"])
            if parsed is not None:
                function["arguments"] = parsed
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _call_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {"name": function.get("name"), "arguments": function.get("arguments", {})}


# ---- the grammar -----------------------------------------------------------------------------------------
def tool_call_grammar(tools: list[dict[str, Any]], max_calls: int = MAX_PARALLEL_CALLS) -> str:
    """Lark (llguidance's dialect) for 1..max_calls `<tool_call>` blocks, each a call of one of `tools` whose
    arguments validate against the function's parameters (objects closed to extra keys, as for response formats).

    Calls are joined by one "\\n" (Qwen / Hermes layout). After a call the model ends the calls with EOS or with a
    blank line (which then finishes the output): a small model that would go on in prose after its call wants "\\n"
    first, and a grammar that then allowed only EOS or another `<tool_call>` made it write a second, junk call."""
    rules, names = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        check_schema(function.get("parameters") or {})  # before close_objects walks it
        params = close_objects(dict(function.get("parameters") or {"type": "object"}))
        # "$ref": "#/$defs/X" resolves from the schema's root, which is now the call object: move $defs up there
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        call = {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False, **defs,
                "x-guidance": CALL_JSON_LAYOUT}
        rules.append(f"fn_{i}: %json {json.dumps(call, ensure_ascii=False)}")
        names.append(f"fn_{i}")
    more = f' ("\\n" tool_call){{0,{max_calls - 1}}}' if max_calls > 1 else ""
    return "\n".join([f'start: tool_call{more} "\\n"{{0,2}}',
                      f'tool_call: "{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"',
                      "call: " + " | ".join(names), *rules])


def forced_tools(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    """The functions a "required" or named tool_choice lets the model call; an unknown name is the client's error."""
    if tool_choice == "required":
        return tools
    name = tool_choice["function"]["name"]
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools")
    return chosen


# ---- parsing the output ----------------------------------------------------------------------------------
def parse_tool_calls(text: str, final: bool = True, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
    """Split model output into its content and its well-formed calls. A block that is not a JSON call of one of
    `names` (any name if None) stays in the content. Unless `final`, a call still being written and a trailing
    partial `<tool_call>` tag are held back; when final, an unclosed last block that is a whole call counts (the
    model stopped before the closing tag). Whitespace-only text after a call is dropped."""
    content, calls, pos = [], [], 0

    def add(piece: str) -> None:  # whitespace after a call (the "\n" between calls) is not content
        if piece.strip() or pos == 0:
            content.append(piece)

    while True:
        start = text.find(CALL_OPEN, pos)
        if start == -1:
            tail = text[pos:]
            add(tail if final else tail[:len(tail) - _partial_tag(tail)])
            break
        add(text[pos:start])
        end = text.find(CALL_CLOSE, start)
        body = text[start + len(CALL_OPEN):end if end != -1 else len(text)]
        if end == -1 and not final:
            break
        call = _call_of(body, names)
        if call is None:
            content.append(text[start:end + len(CALL_CLOSE) if end != -1 else len(text)])
        else:
            calls.append(call)
        if end == -1:
            break
        pos = end + len(CALL_CLOSE)
    return "".join(content), calls


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that could begin a `<tool_call>` tag."""
    return next((n for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1) if CALL_OPEN.startswith(text[-n:])), 0)


def _call_of(body: str, names: frozenset[str] | None) -> ToolCall | None:
    obj = strict_json(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None  # a function the request did not offer: the client could not run it
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def strict_json(text: str) -> Any:
    """`text` parsed as JSON proper, or None: Python's parser also takes NaN, Infinity and 1e999 (read as inf),
    which no other JSON parser does, and raises RecursionError on 1,000 nested `[`."""
    try:
        return json.loads(text, parse_constant=_refuse, parse_float=_finite)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


def _refuse(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"{number} is out of range")
    return value


@dataclass
class ToolCallStream:
    """What a streamed choice has sent: deltas of content outside calls, and each call once it is complete."""

    content_sent: int = 0
    calls: list[ToolCall] = field(default_factory=list)
    names: frozenset[str] | None = None  # the functions offered: a call of any other stays content

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """New content and new calls in the output so far. Whitespace-only content is not sent until real text
        follows (a "\\n" between calls is not content)."""
        content, calls = parse_tool_calls(text, final, self.names)
        new_calls = calls[len(self.calls):]
        for old, new in zip(self.calls, calls):
            new.id = old.id  # the same call, parsed again
        self.calls = calls
        delta = content[self.content_sent:]
        if not content.strip():
            return "", new_calls
        self.content_sent = len(content)
        return delta, new_calls
