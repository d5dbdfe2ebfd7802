"""OpenAI's Responses API (/v1/responses) through the official `openai` client, against a server on the tiny model:
greedy outputs equal the chat-completions path for the same conversation, streamed or not; tool calls and their
outputs fed back; `responses.parse`; stored responses (previous_response_id, GET, DELETE, background and cancel,
the prefix cache hit turn by turn) and the store's bounds; bad input."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import no_retry_client
from test_server import launch, metrics
from test_structured_server import Person
from test_tool_calls import MODELS, TOOLS

from pagedllm.bench.server_process import ServerProcess
from pagedllm.entrypoints.openai.protocol_responses import OutputMessage, OutputText, ResponseObject
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse

STORE_SIZE = 8
TTL = 8.0
INSTRUCTIONS = "You are terse."
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("responses-server") / "server.log"
    with launch(tiny_model_dir, log, "--num-blocks", "512", "--max-model-len", "1024", "--served-model-name", "tiny",
                "--responses-store-size", str(STORE_SIZE), "--responses-store-ttl", str(TTL)) as srv:
        yield srv
    assert "Traceback" not in Path(srv.log_path).read_text(errors="replace"), srv.log_tail()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return no_retry_client(openai.OpenAI, f"{server.url}/v1", api_key="unused", timeout=120)


def chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs).choices[0]


def test_create_equals_chat_completions(client):
    r = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input="Name a colour.", temperature=0,
                                max_output_tokens=24)
    c = chat(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a colour."}],
             max_tokens=24)
    assert r.object == "response" and r.model == "tiny" and r.output_text == c.message.content
    assert r.status == ("incomplete" if c.finish_reason == "length" else "completed")
    assert r.usage.output_tokens == 24 and r.usage.total_tokens == r.usage.input_tokens + 24


def test_input_items_equal_chat(client):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."},
                                                            {"type": "input_text", "text": "A colour?"}]},
             {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    r = client.responses.create(model="tiny", input=items, temperature=0, max_output_tokens=16)
    c = chat(client, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi.\nA colour?"},
                      {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
             max_tokens=16)
    assert r.output_text == c.message.content


def test_stream_equals_create_in_the_clients_order(client):
    kwargs = dict(model="tiny", input="Name a colour.", temperature=0, max_output_tokens=32)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert client.responses.retrieve(events[-1].response.id).output_text == text  # stored once streamed


def test_tool_calls_and_their_outputs_fed_back(client):
    """tool_choice required: valid calls, streamed the same; their outputs continue the conversation as chat."""
    user = {"role": "user", "content": "What is the weather in Paris?"}
    kwargs = dict(model="tiny", input=[user], tools=RESPONSE_TOOLS, tool_choice="required", temperature=0,
                  max_output_tokens=200)
    r = client.responses.create(**kwargs)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        MODELS[call.name].model_validate_json(call.arguments)
    c = chat(client, [user], max_tokens=200, tools=TOOLS, tool_choice="required")
    assert [(i.name, i.arguments) for i in calls] == [(t.function.name, t.function.arguments)
                                                      for t in c.message.tool_calls]
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in streamed] == [(i.name, i.arguments) for i in calls]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        "".join(i.arguments for i in calls)

    outputs = [{"type": "function_call_output", "call_id": i.call_id, "output": "22 degrees"} for i in calls]
    turn = client.responses.create(model="tiny", input=[user, *[i.model_dump() for i in calls], *outputs],
                                   tools=RESPONSE_TOOLS, temperature=0, max_output_tokens=24)
    chained = client.responses.create(model="tiny", previous_response_id=r.id, input=outputs, tools=RESPONSE_TOOLS,
                                      temperature=0, max_output_tokens=24)
    again = chat(client, [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
        for i in calls]}, *[{"role": "tool", "tool_call_id": i.call_id, "content": "22 degrees"} for i in calls]],
        max_tokens=24, tools=TOOLS)
    assert turn.output_text == chained.output_text == (again.message.content or "")


def test_named_tool_choice(client):
    r = client.responses.create(model="tiny", input="1 + 2?", tools=RESPONSE_TOOLS, temperature=0.8,
                                tool_choice={"type": "function", "name": "add"}, parallel_tool_calls=False,
                                max_output_tokens=200)
    assert [i.name for i in r.output if i.type == "function_call"] == ["add"]


def test_parse_with_a_pydantic_model(client):
    for i in range(3):
        r = client.responses.parse(model="tiny", input=f"Describe person {i} as JSON.", text_format=Person,
                                   temperature=0.8, max_output_tokens=400)
        assert r.status == "completed" and isinstance(r.output_parsed, Person)


def test_stored_conversation_hits_the_prefix_cache_turn_by_turn(client, server):
    """10 turns chained by previous_response_id: each equals chat over the whole conversation, and each turn's
    prompt finds more of itself in the prefix cache than the last."""
    key = ("pagedllm:prefix_cache_hits_total", ())
    messages = [{"role": "system", "content": INSTRUCTIONS}]
    previous, hits = None, []
    for turn in range(10):
        messages.append({"role": "user", "content": f"Turn {turn}: and then?"})
        before = metrics(server)[key]
        r = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=messages[-1]["content"],
                                    previous_response_id=previous, temperature=0, max_output_tokens=8)
        hits.append(metrics(server)[key] - before)
        c = chat(client, messages, max_tokens=8)
        assert r.output_text == c.message.content and r.previous_response_id == previous
        messages.append({"role": "assistant", "content": r.output_text})
        previous = r.id
    assert all(b > a for a, b in zip(hits[1:], hits[2:])), hits


def test_get_delete_and_unknown_ids(client, server):
    r = client.responses.create(model="tiny", input="Hi", temperature=0, max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.create(model="tiny", input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model="tiny", input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        client.responses.cancel(client.responses.create(model="tiny", input="Hi", max_output_tokens=2).id)


def test_an_expired_response_is_gone(client):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    time.sleep(TTL + 0.5)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id=r.id)


def test_background_response_completes_or_is_cancelled(client):
    r = client.responses.create(model="tiny", input="Hi", background=True, temperature=0, max_output_tokens=8)
    assert r.status == "queued" and r.background
    for _ in range(600):
        r = client.responses.retrieve(r.id)
        if r.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert r.status == "incomplete" and r.usage.output_tokens == 8
    long = client.responses.create(model="tiny", input="Hi", background=True, max_output_tokens=900)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"


def test_a_flood_of_stored_responses_stays_within_the_bound(client, server):
    ids = [client.responses.create(model="tiny", input=f"flood {i}", max_output_tokens=1).id
           for i in range(3 * STORE_SIZE)]
    kept = [i for i in ids if httpx.get(f"{server.url}/v1/responses/{i}").status_code == 200]
    # the newest are kept, never more than the bound (under a heavy load the oldest of them may have expired)
    assert ids[-1] in kept and set(kept) <= set(ids[-STORE_SIZE:]), (kept, ids)


def test_store_bounds_entries_bytes_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=3, ttl=10, max_bytes=5000, clock=lambda: now[0])

    def entry(i: int, chars: int = 10) -> StoredResponse:
        message = OutputMessage(id=f"m{i}", content=[OutputText(text="x" * chars)])
        return StoredResponse(ResponseObject(id=f"r{i}", status="completed", model="m", output=[message]),
                              [{"role": "user", "content": "y" * chars}])

    for i in range(5):
        store.put(entry(i))
    assert len(store) == 3 and store.get("r0") is None and store.get("r2") is not None
    store.put(entry(5))  # r2 was used last: r3 goes
    assert store.get("r3") is None and store.get("r2") is not None
    store.put(entry(6, chars=2000))
    assert store.bytes <= 5000 and store.get("r6") is not None
    store.put(entry(7, chars=6000))  # larger than the whole store: not kept
    assert store.get("r7") is None and store.bytes <= 5000
    now[0] = 9.0
    assert store.get("r6") is not None
    now[0] = 15.0  # r6 was used at 9: alive; the others expired
    assert store.get("r6") is not None and len(store) == 1


@pytest.mark.parametrize("body,status,field", [
    ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, 400, "input.0.function_call.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input.0.function_call_output.output"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input.0"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input.0.message.role"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 5000}, 400, "context length"),
    ({"input": "hi", "previous_response_id": "resp-nope"}, 404, "resp-nope"),
    ({"input": "hi", "background": True, "stream": True}, 400, "background"),
])
def test_bad_input_names_the_field(server, body, status, field):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    assert field in r.json()["error"]["message"], r.json()


def test_json_object_format(client):
    r = client.responses.create(model="tiny", input="JSON please", text={"format": {"type": "json_object"}},
                                temperature=0, max_output_tokens=40)
    assert r.output_text.startswith("{")
    assert json.dumps(r.text.format.type) == '"json_object"'


def test_metrics_by_endpoint(client, server):
    before = metrics(server)
    client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    after = metrics(server)
    for endpoint in ("/v1/responses", "/v1/chat/completions"):
        key = ("pagedllm:endpoint_requests_total", (("endpoint", endpoint),))
        assert after[key] == before.get(key, 0) + 1


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 900, "stream": True}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 900, "stream": True, "messages": [{"role": "user",
                                                                                       "content": "Hi"}]}),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 900}),
])
def test_a_client_that_leaves_aborts_its_request(server, path, body):
    """Greedy, so that the random model's answer runs its 900 tokens (~3 s here): sampled, it can end at an early
    EOS (one of five such answers ended after 306), before the 0.5-s client leaves, and nothing is left to abort."""
    body = {**body, "temperature": 0}
    key = ("pagedllm:request_success_total", (("finished_reason", "abort"),))
    before = metrics(server).get(key, 0)
    with pytest.raises(httpx.ReadTimeout) if not body.get("stream") else contextlib.nullcontext():
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=0.5 if not body.get("stream") else 60) as r:
            next(r.iter_lines())
    deadline = time.monotonic() + 30
    while metrics(server).get(key, 0) < before + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)


def test_long_texts_are_not_lists(client):
    """The bounds on the number of items and parts leave the length of a text alone."""
    long = "word " * 600
    r = client.responses.create(model="tiny", input=long, max_output_tokens=1)
    assert client.responses.create(model="tiny", input=[{"role": "user", "content": long}],
                                   max_output_tokens=1).usage.input_tokens == r.usage.input_tokens
