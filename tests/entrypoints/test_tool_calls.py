"""Tool calling's parts without a server: the Hermes-style prompt for a template without tools, the parser (whole and
streamed), and the forced-call grammar, walked with random logits under its mask (no model: the grammar alone must
make every call valid)."""

from __future__ import annotations

import json
from enum import Enum

import pytest
import torch
from pydantic import BaseModel, Field

from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.response_format import structured_outputs_of
from pagedllm.entrypoints.openai.tool_calls import (
    ToolCallStream,
    parse_tool_calls,
    render_tool_messages,
    template_knows_tools,
    tool_call_grammar,
)
from pagedllm.errors import InvalidRequestError
from pagedllm.model.sampler import GrammarMask, apply_grammar_mask_
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import StructuredOutputsParams


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Weather(BaseModel):
    city: str = Field(max_length=16)
    unit: Unit  # Pydantic puts the enum in $defs: the grammar must hoist them


class Add(BaseModel):
    x: int = Field(ge=-1000, le=1000)
    y: int = Field(ge=-1000, le=1000)


MODELS = {"get_weather": Weather, "add": Add}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": model.model_json_schema()}}
         for name, model in MODELS.items()]
CALL = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


# ---- parsing ---------------------------------------------------------------------------------------------
def test_parse_calls_and_content():
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    text = f"Let me add.\n{CALL}\n{weather}"
    content, calls = parse_tool_calls(text)
    assert content.strip() == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"x": 1, "y": 2}), ("get_weather", {})]
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")


def test_parse_keeps_malformed_blocks_as_content_and_takes_an_unclosed_last_call():
    bad = "<tool_call>\nnot json\n</tool_call>"
    content, calls = parse_tool_calls(f"a {bad} b")
    assert content == f"a {bad} b" and calls == []
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"x": 1}}')  # stopped before the tag
    assert content == "" and calls[0].name == "add"
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"x": 1}', final=False)
    assert content == "" and calls == []  # still being written


def test_stream_sends_content_then_each_call_once():
    text = f"Sure. {CALL}\n{CALL}"
    stream, content, calls = ToolCallStream(), "", []
    for end in range(1, len(text) + 1):
        delta, new = stream.update(text[:end], final=False)
        content += delta
        calls += new
        assert "<" not in content  # a partial "<tool_call>" tag is held back
    delta, new = stream.update(text, final=True)
    content, calls = content + delta, calls + new
    assert content == "Sure. " and len(calls) == 2
    assert [c.arguments for c in calls] == [c.arguments for c in parse_tool_calls(text)[1]]
    assert [c.id for c in calls] == [c.id for c in stream.calls]


def test_stream_whitespace_between_calls_is_not_content():
    stream = ToolCallStream()
    assert stream.update(CALL + "\n", final=False)[0] == ""
    assert stream.update(CALL + "\n" + CALL, final=True) == ("", [stream.calls[1]])


# ---- the prompt ------------------------------------------------------------------------------------------
def test_hermes_prompt_for_a_template_without_tools(tokenizer):
    assert not template_knows_tools(tokenizer.chat_template)
    messages = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"x": 1, "y": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    rendered, extra = render_tool_messages(messages, TOOLS, template_has_tools=False)
    assert extra == {}
    text = tokenizer.apply_chat_template(rendered)
    assert text.startswith("<|im_start|>system\n# Tools")  # the default system prompt gives way to the tools
    assert json.dumps(TOOLS[0]) in text
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in text  # arguments rendered as an object
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # a system message of the client's keeps its text, the tools follow it
    rendered, _ = render_tool_messages([{"role": "system", "content": "Be brief."}], TOOLS, False)
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools")


def test_a_template_that_knows_tools_gets_them():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"x": 1}'}}]}]
    rendered, extra = render_tool_messages(messages, TOOLS, template_has_tools=True)
    assert extra == {"tools": TOOLS}
    assert rendered[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # as templates expect


# ---- requests -> constraints -----------------------------------------------------------------------------
def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_tool_choice_to_grammar():
    assert structured_outputs_of(request(tools=TOOLS)) is None  # auto: free text
    assert structured_outputs_of(request(tools=TOOLS, tool_choice="none")) is None
    required = structured_outputs_of(request(tools=TOOLS, tool_choice="required"))
    assert "get_weather" in required.grammar and "add" in required.grammar
    assert 'tool_call){0,3}' in required.grammar  # 1..4 calls
    one = structured_outputs_of(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert "tool_call){" not in one.grammar
    for parallel in (True, False):  # a named function is exactly one call, whatever parallel_tool_calls says
        named = structured_outputs_of(request(tools=TOOLS, parallel_tool_calls=parallel,
                                              tool_choice={"type": "function", "function": {"name": "add"}}))
        assert "get_weather" not in named.grammar and "tool_call){" not in named.grammar


@pytest.mark.parametrize("fields,message", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not in tools"),
    (dict(tool_choice="required"), "needs tools"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "at most one"),
    (dict(tools=TOOLS, tool_choice="required", guided_choice=["a"]), "at most one"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "needs json_schema.schema"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "exactly one"),
])
def test_conflicting_or_incomplete_constraints(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        structured_outputs_of(request(**fields))


def test_response_format_and_vllm_names():
    schema = Add.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "add", "schema": schema, "strict": True}}
    assert structured_outputs_of(request(response_format=fmt)) == StructuredOutputsParams(json=schema)
    assert structured_outputs_of(request(response_format={"type": "text"})) is None
    assert structured_outputs_of(request(response_format={"type": "json_object"})).json_object
    assert structured_outputs_of(request(structured_outputs={"json": schema})).json == schema
    assert structured_outputs_of(request(guided_regex=r"\d+")).regex == r"\d+"


# ---- the forced-call grammar -----------------------------------------------------------------------------
def random_walk(manager: StructuredOutputManager, spec: StructuredOutputsParams, tokenizer: Tokenizer,
                generator: torch.Generator, max_tokens: int = 300) -> str:
    """Sample random logits under the grammar's mask until it ends: only the grammar keeps the text valid."""
    matcher = manager.new_matchers(spec, 1)[0]
    ids: list[int] = []
    for _ in range(max_tokens):
        logits = torch.empty(1, manager.vocab_size).exponential_(generator=generator).log_().neg_()  # Gumbel
        apply_grammar_mask_(logits, GrammarMask(torch.tensor([0]), manager.fill_bitmask([matcher])))
        token = int(logits.argmax())  # a uniform draw among the allowed tokens
        assert matcher.consume_token(token), matcher.get_error()
        if matcher.is_stopped() or token in manager.eos_token_ids:
            break
        ids.append(token)
    assert matcher.is_accepting()
    return tokenizer.decode(ids)


@pytest.fixture
def one_thread():
    """Elementwise ops over one row of 49k logits: one thread is faster, and steady on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_forced_calls_always_validate(tokenizer, one_thread):
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size, tokenizer.end_of_generation_ids())
    spec = StructuredOutputsParams(grammar=tool_call_grammar(TOOLS))
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(8):
        text = random_walk(manager, spec, tokenizer, generator)
        content, calls = parse_tool_calls(text)
        assert content.strip() == "" and 1 <= len(calls) <= 4, text
        for call in calls:
            MODELS[call.name].model_validate_json(call.arguments)
            seen.add(call.name)
    assert seen == set(MODELS)


def walk(manager: StructuredOutputManager, spec: StructuredOutputsParams, tokenizer: Tokenizer, text: str):
    """A matcher moved past `text`'s tokens (each must be allowed)."""
    matcher = manager.new_matchers(spec, 1)[0]
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.consume_token(token), (text, matcher.get_error())
    return matcher


def allowed(manager: StructuredOutputManager, matcher) -> set[int]:
    mask = manager.fill_bitmask([matcher])[0]
    return {t for t in range(manager.vocab_size) if (int(mask[t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("max_calls", [1, 4])
def test_forced_calls_end_when_the_model_ends(tokenizer, max_calls):
    """After one call the model may end (EOS) and no further call is forced; a blank line also ends the calls
    (the grammar is then complete), where the old grammar allowed only EOS or another call after "\n" and a small
    model that wanted to go on in prose wrote a second, junk call instead."""
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size, tokenizer.end_of_generation_ids())
    spec = StructuredOutputsParams(grammar=tool_call_grammar(TOOLS, max_calls))
    eos = set(manager.eos_token_ids)
    after_call = walk(manager, spec, tokenizer, CALL)
    assert eos <= allowed(manager, after_call) and not after_call.is_stopped()
    assert walk(manager, spec, tokenizer, CALL + "\n\n").is_stopped()
    second = walk(manager, spec, tokenizer, CALL + "\n")
    opens_call = tokenizer.encode("<", add_special_tokens=False)[0]
    assert (opens_call in allowed(manager, second)) == (max_calls > 1)
    if max_calls == 1:
        assert walk(manager, spec, tokenizer, CALL + "\n").is_accepting()
