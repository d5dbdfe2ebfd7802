"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client, against a server on the tiny
model: greedy outputs equal the chat-completions path for the same conversation, streamed or not, with tool use
round trips; Anthropic's error bodies and its x-api-key header."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import no_retry_client
from test_server import launch
from test_tool_calls import MODELS, TOOLS

from pagedllm.bench.server_process import ServerProcess

API_KEY = "sk-test-messages"
SYSTEM = "You are terse."
USER = "Name a colour."
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
GREEDY = {"temperature": 0}  # anthropic's client no longer takes temperature as an argument


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("messages-server") / "server.log"
    with launch(tiny_model_dir, log, "--num-blocks", "256", "--max-model-len", "1024", "--served-model-name", "tiny",
                "--api-key", API_KEY) as srv:
        yield srv
    assert "Traceback" not in Path(srv.log_path).read_text(errors="replace"), srv.log_tail()


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return no_retry_client(anthropic.Anthropic, server.url, api_key=API_KEY, timeout=120)


@pytest.fixture(scope="module")
def gpt(server: ServerProcess) -> openai.OpenAI:
    return no_retry_client(openai.OpenAI, f"{server.url}/v1", api_key=API_KEY, timeout=120)


def chat(gpt: openai.OpenAI, messages: list[dict], **kwargs):
    return gpt.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs).choices[0]


def test_create_equals_chat_completions(claude, gpt):
    m = claude.messages.create(model="tiny", max_tokens=24, system=SYSTEM, extra_body=GREEDY,
                               messages=[{"role": "user", "content": USER}])
    c = chat(gpt, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], max_tokens=24)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == c.message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.finish_reason]
    assert m.usage.output_tokens == 24 and m.usage.input_tokens > 0


def test_content_blocks_and_multi_turn_equal_chat(claude, gpt):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": USER}]},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    m = claude.messages.create(model="tiny", max_tokens=16, messages=messages, extra_body=GREEDY)
    c = chat(gpt, [{"role": "user", "content": f"Hi.\n{USER}"}, {"role": "assistant", "content": "Blue."},
                   {"role": "user", "content": "Another?"}], max_tokens=16)
    assert m.content[0].text == c.message.content


def test_stream_equals_create(claude):
    kwargs = dict(model="tiny", max_tokens=32, messages=[{"role": "user", "content": USER}], extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences(claude):
    kwargs = dict(model="tiny", max_tokens=32, messages=[{"role": "user", "content": USER}], extra_body=GREEDY)
    text = claude.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    m = claude.messages.create(**kwargs, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_tool_use_round_trip_equals_chat(claude, gpt):
    """tool_choice any forces valid calls (streamed the same); the result fed back continues as chat would."""
    user = {"role": "user", "content": "What is the weather in Paris?"}
    kwargs = dict(model="tiny", max_tokens=200, tools=ANTHROPIC_TOOLS, messages=[user], extra_body=GREEDY)
    m = claude.messages.create(**kwargs, tool_choice={"type": "any"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses
    for use in uses:
        MODELS[use.name].model_validate(use.input)
    c = chat(gpt, [user], max_tokens=200, tools=TOOLS, tool_choice="required")
    assert [(u.name, u.input) for u in uses] == [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    with claude.messages.stream(**kwargs, tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [(u.name, u.input) for u in uses]
    assert final.stop_reason == "tool_use"

    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "22 degrees"} for u in uses]
    turn = claude.messages.create(**{**kwargs, "max_tokens": 24, "messages": [
        user, {"role": "assistant", "content": [u.model_dump() for u in uses]}, {"role": "user", "content": results}]})
    again = chat(gpt, [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
        for u in uses]}, *[{"role": "tool", "tool_call_id": u.id, "content": "22 degrees"} for u in uses]],
        max_tokens=24, tools=TOOLS)
    text = "".join(b.text for b in turn.content if b.type == "text")
    assert text == (again.message.content or "")


def test_named_tool_choice(claude):
    m = claude.messages.create(model="tiny", max_tokens=200, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": "1 + 2?"}])
    assert [b.name for b in m.content if b.type == "tool_use"] == ["add"]


def test_count_tokens_equals_tokenize(claude, server):
    n = claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=[{"role": "user", "content": USER}])
    r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "system", "content": SYSTEM},
                                                                {"role": "user", "content": USER}]})
    assert n.input_tokens == r.json()["count"]


@pytest.mark.parametrize("body,status,words", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ({"model": "tiny", "max_tokens": 8, "messages": []}, 400, "messages"),
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "add", "input": {}}]}]}, 400, "messages.0.content.0.type"),
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result"}]}]}, 400, "messages.0.content.0.tool_use_id"),
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "messages.0.content.0"),
    ({"model": "tiny", "max_tokens": 8, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"},
      "messages": [{"role": "user", "content": "hi"}]}, 400, "nope"),
    ({"model": "tiny", "max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]}, 400, "context length"),
    ({"model": "claude-nope", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}, 404, "claude-nope"),
])
def test_bad_input_gets_anthropic_errors(server, body, status, words):
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and words in error["error"]["message"], error
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]


def test_the_client_raises_on_errors_and_keys(claude, server):
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "tool_result"}]}])
    bad = no_retry_client(anthropic.Anthropic, server.url, api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(f"{server.url}/v1/messages", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert bearer.status_code == 200 and bearer.json()["usage"]["output_tokens"] == 2
    samples = httpx.get(f"{server.url}/metrics").text
    assert 'pagedllm:endpoint_requests_total{endpoint="/v1/messages",model_name="tiny"}' in samples


def test_output_config_json_schema(claude):
    schema = MODELS["add"].model_json_schema()
    m = claude.messages.create(model="tiny", max_tokens=200, messages=[{"role": "user", "content": "1 + 2?"}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn"
    MODELS["add"].model_validate_json(m.content[0].text)


def test_long_texts_are_not_lists(claude):
    m = claude.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "word " * 600}])
    assert m.usage.input_tokens > 600
