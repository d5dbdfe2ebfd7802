"""Issue 34, grammars: no grammar takes the server down, holds memory without bound, compiles without a time limit or
is silently not honoured; tool calls name only offered functions with JSON arguments; odd request values are 400s.
The crash repros against a real `pagedllm serve` on the tiny model; the limits, the worker and the parsers in-process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import llguidance as llg
import pytest

from pagedllm.bench.server_process import ServerProcess as Server
from pagedllm.engine.grammar_limits import (
    MAX_REPEAT,
    check_lark,
    check_schema,
    load_schema_text,
    repeat_product,
)
from pagedllm.engine.grammar_worker import GrammarWorker
from pagedllm.engine.structured_output import GrammarBrokenError, StructuredOutputManager, advance_grammar
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.tool_calls import ToolCallStream, parse_tool_calls, tool_call_grammar
from pagedllm.errors import InvalidRequestError
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import StructuredOutputsParams

REPO = Path(__file__).resolve().parents[2]


def ref_chain(depth: int) -> dict:
    """The issue's crash: a schema whose `$ref` chain is `depth` object definitions deep (1,000: 94 KB)."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["next"]}
            for i in range(depth)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{depth}": {"type": "string"}}}


def rule_chain(rules: int) -> str:
    """The issue's other crash: a Lark grammar of `rules` rules, each using the next."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(rules)), f'r{rules}: "a"'])


# ---- the limits, before llguidance -----------------------------------------------------------------------
@pytest.mark.parametrize("regex,product", [("a{1000000}", 1_000_000), ("(X{1000}){1000}", 1_000_000),
                                           (r"[0-9]{3}-\d{4}", 4), ("(ab{3}){2,5}c{2,}", 15), (r"a\{99999\}", 1),
                                           ("[{]{7}", 7), (r"\p{L}{5}", 5), ("((a{100}){100}){2}", 20_000)])
def test_repeat_product(regex: str, product: int) -> None:
    assert repeat_product(regex) == product


def test_deep_schemas_and_rule_chains_are_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError, match="nests deeper than the limit of 128"):
        check_schema(ref_chain(1000))
    check_schema(ref_chain(40))
    recursive = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    check_schema(recursive)  # a cycle is recursion, which llguidance handles: not a deep chain
    with pytest.raises(InvalidRequestError, match="nests objects and arrays deeper"):
        load_schema_text("[" * 1200 + "]" * 1200)  # Python's own parser raises RecursionError here
    with pytest.raises(InvalidRequestError, match="rules, over the limit of 5,000"):
        check_lark(rule_chain(5000))
    with pytest.raises(InvalidRequestError, match="chains rules deeper than the limit of 200"):
        check_lark(rule_chain(1000))
    with pytest.raises(InvalidRequestError, match="chains rules deeper"):  # GBNF becomes Lark (terminals) first
        check_lark(llg.grammar_from("grammar", "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(
            1000)), 'r1000 ::= "a"'])))
    with pytest.raises(InvalidRequestError, match="nests deeper"):  # a schema inside a grammar
        check_lark(f"start: a\na: %json {json.dumps(ref_chain(1000))}")
    check_lark(rule_chain(150))
    tools = [{"function": {"name": "f", "parameters": ref_chain(1000)}}]
    with pytest.raises(InvalidRequestError, match="nests deeper"):
        tool_call_grammar(tools)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> Iterator[StructuredOutputManager]:
    m = StructuredOutputManager(tokenizer, 49152, [2], cache_bytes=8 << 20)
    yield m
    m.worker.close()


@pytest.mark.parametrize("spec,message", [
    (StructuredOutputsParams(json=ref_chain(1000)), "nests deeper"),
    (StructuredOutputsParams(grammar=rule_chain(5000)), "over the limit of 5,000"),
    (StructuredOutputsParams(regex="a{1000000}"), f"over the limit of {MAX_REPEAT:,}"),
    (StructuredOutputsParams(regex="(X{1000}){1000}"), "repeats 1,000,000 times"),
    (StructuredOutputsParams(choice=[f"c{i}" for i in range(100_000)]), "100,000 entries, over the limit"),
    (StructuredOutputsParams(regex="\ud800"), "lone UTF-16 surrogate"),
    (StructuredOutputsParams(json="[" * 1200 + "]" * 1200), "deeper than the limit"),
    (StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=" {100000}"), "whitespace pattern"),
    (StructuredOutputsParams(grammar="start: foo"), "unknown name"),
])
def test_manager_refuses_with_the_limit_named(manager: StructuredOutputManager, spec, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        manager.compile(spec)
    with pytest.raises(InvalidRequestError, match=message):  # again, from the refusals' cache
        manager.compile(spec)


def test_cache_is_bounded_in_bytes(manager: StructuredOutputManager) -> None:
    """b{4000} holds ~2 MB as the worker measures it: an 8 MB cache keeps the newest few, not 256."""
    specs = [StructuredOutputsParams(regex=f"b{{{4000 + i}}}") for i in range(6)]
    compiled = [manager.compile(s) for s in specs]
    assert all(c.bytes > 1 << 20 for c in compiled)
    assert manager.cached_bytes <= manager.cache_bytes
    assert manager.compile(specs[-1]) is compiled[-1]  # the newest is cached
    assert manager.compile(specs[0]) is not compiled[0]  # the oldest was evicted


def test_a_refused_token_fails_instead_of_finishing(manager: StructuredOutputManager, tokenizer: Tokenizer) -> None:
    matcher = manager.new_matchers(StructuredOutputsParams(regex="[0-9]{3}"), 1)[0]
    with pytest.raises(GrammarBrokenError, match="could not follow its grammar"):
        advance_grammar(matcher, tokenizer.encode("hello", add_special_tokens=False)[0])


# ---- the worker: what llguidance cannot survive costs the child --------------------------------------------
@pytest.fixture(scope="module")
def worker(tokenizer: Tokenizer) -> Iterator[GrammarWorker]:
    w = GrammarWorker(tokenizer.backend.to_str(), 49152, [2], time_limit_s=1.0, memory_limit=32 << 20)
    yield w
    w.close()


def test_worker_survives_a_crash_a_timeout_and_a_memory_hog(worker: GrammarWorker) -> None:
    with pytest.raises(InvalidRequestError, match="crashed on this grammar"):
        worker.trial(rule_chain(3000))  # SIGSEGV in llguidance: the limits stop this before the worker sees it
    with pytest.raises(InvalidRequestError, match="within the limit of 1 s"):
        worker.trial(llg.grammar_from("choice", json.dumps([f"option number {i}" for i in range(60_000)])))
    with pytest.raises(InvalidRequestError, match="over the limit of 32 MB"):
        worker.trial(llg.LLMatcher.grammar_from_lark("start: /(X{300}){300}/"))
    ok = worker.trial('start: "yes" | "no"')
    assert 0 < ok.bytes < 32 << 20 and ok.seconds < 1.0


# ---- tool calls ----------------------------------------------------------------------------------------------
def test_tool_calls_of_unknown_functions_and_non_json_arguments_stay_content() -> None:
    text = ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get", "arguments": {"x": NaN}}</tool_call>'
            '<tool_call>{"name": "get", "arguments": {"x": 1e999}}</tool_call>'
            '<tool_call>{"name": "get", "arguments": {"x": -Infinity}}</tool_call>'
            '<tool_call>' + "[" * 1200 + '</tool_call>'
            '<tool_call>{"name": "get", "arguments": {"x": 1.5}}</tool_call>')
    content, calls = parse_tool_calls(text, names=frozenset({"get"}))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get", {"x": 1.5})]
    assert "rm_rf" in content and "NaN" in content and "1e999" in content and "Infinity" in content
    streamed, new_calls = ToolCallStream(names=frozenset({"get"})).update(text, final=True)
    assert [(c.name, c.arguments) for c in new_calls] == [(c.name, c.arguments) for c in calls]
    assert "rm_rf" in streamed


# ---- request values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [{"prompt": [True, False]}, {"prompt": "x", "stop_token_ids": [2**70]},
                                  {"prompt": "x", "max_tokens": True}, {"prompt": [[1, -1]]},
                                  {"prompt": "x", "structured_outputs": {"regex": "\ud800"}}])
def test_odd_values_are_refused(body: dict) -> None:
    with pytest.raises(ValueError):
        CompletionRequest.model_validate(body)
    CompletionRequest.model_validate({"prompt": [1, 2], "max_tokens": 3, "temperature": 1, "stop_token_ids": [2]})
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "tools": [{"function": {"name": "f\ud800"}}]})


# ---- the server: each crash repro is a 400 naming its limit, and the server serves on ---------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("grammar-limits") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = ["--model", tiny_model_dir, "--dtype", "float32", "--threads", "1", "--num-blocks", "256",
            "--max-model-len", "2048"]
    with Server(argv, str(log), timeout=120, env=env) as s:
        yield s


def chat(server: Server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})


def completion(server: Server, content: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", content=content, timeout=120,
                      headers={"Content-Type": "application/json"})


DEEP = "[" * 1200 + "]" * 1200
SERVER_CASES = {
    "ref_chain": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(1000)}}},
                  "nests deeper than the limit of 128"),
    "rule_chain": ({"structured_outputs": {"grammar": rule_chain(5000)}}, "over the limit of 5,000"),
    "huge_repeat": ({"structured_outputs": {"regex": "a{1000000}"}}, "over the limit of 5,000"),
    "memory_regex": ({"structured_outputs": {"regex": "(X{1000}){1000}"}}, "over the limit of 5,000"),
    "choices": ({"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}, "over the limit of 10,000"),
    "schema_text": ({"structured_outputs": {"json": DEEP}}, "deeper than the limit of 128"),
    "tool_params": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ref_chain(1000)}}],
                     "tool_choice": "required"}, "nests deeper"),
}


@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_crash_repros_are_400s_and_the_server_serves_on(server: Server, case: str) -> None:
    body, message = SERVER_CASES[case]
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert chat(server).status_code == 200


def test_odd_bodies_are_400s_not_500s(server: Server) -> None:
    for content in ['{"prompt": "x", "structured_outputs": {"regex": "\\ud800"}}', '{"prompt": [true, false]}',
                    '{"prompt": "x", "stop_token_ids": [1180591620717411303424]}',
                    '{"prompt": "x", "max_tokens": true}']:
        r = completion(server, content)
        assert r.status_code == 400, (content, r.text)
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": DEEP}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    r = chat(server, messages=history, tools=[{"type": "function", "function": {"name": "f"}}])
    assert r.status_code == 200, r.text
    r = chat(server, structured_outputs={"regex": "[0-9]{3}"}, max_tokens=8)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].isdigit()
