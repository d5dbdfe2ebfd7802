"""The server as a new user meets it (issue 33): a request without max_tokens runs to --default-max-tokens (the rest of
the context when unset, as OpenAI and vLLM), and a structured output that max_tokens cuts says so by its
finish_reason "length" (as vLLM), while `maximum` / `maxLength` in the schema bound what the grammar lets grow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.entrypoints.serve import build_app
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import StructuredOutputsParams

CHAT = {"messages": [{"role": "user", "content": "Count to a thousand."}], "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def http(tiny_model_dir: str) -> Iterator[TestClient]:
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", threads=1, num_blocks=64,
                                    max_model_len=256, attention_backend="reference"))
    with TestClient(build_app(engine, ["m"], ServerConfig(default_max_tokens=7))) as client:
        yield client


def test_a_request_without_max_tokens_stops_at_the_default(http: TestClient):
    choice = http.post("/v1/chat/completions", json=CHAT).json()
    assert choice["usage"]["completion_tokens"] == 7 and choice["choices"][0]["finish_reason"] == "length"
    completion = http.post("/v1/completions", json={"prompt": "one two", "max_tokens": None, "ignore_eos": True})
    assert completion.json()["usage"]["completion_tokens"] == 7


def test_a_request_max_tokens_is_its_own(http: TestClient):
    """The default caps requests that set nothing; one that asks for more gets it (up to the context)."""
    reply = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12}).json()
    assert reply["usage"]["completion_tokens"] == 12


def test_structured_output_cut_by_max_tokens_says_length(http: TestClient):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}).json()
    assert reply["choices"][0]["finish_reason"] == "length"  # the client's sign that the JSON may be incomplete


def test_schema_bounds_are_the_lever_on_length(tiny_model_dir: str):
    """`maximum` and `maxLength` bound an integer's digits and a string's characters in the grammar itself."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size, tokenizer.end_of_generation_ids(), worker=False)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "s": {"type": "string", "maxLength": 4}}, "required": ["n", "s"]}

    def follows(text: str) -> bool:
        matcher = manager.new_matchers(StructuredOutputsParams(json=schema), 1)[0]
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert follows('{"n": 1234') and not follows('{"n": 12345')
    assert follows('{"n": 1, "s": "abcd') and not follows('{"n": 1, "s": "abcde')
