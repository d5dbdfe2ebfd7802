"""The HTTP API's scheduling fields reach the engine: `priority` (vLLM's extra) and the client the fair policy shares
service between: the API key in use (of several), the X-Client-Id header, or OpenAI's `user` field."""

from __future__ import annotations

import argparse

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai.errors import ApiKeyMiddleware, key_client
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.serving import client_of, sampling_params
from pagedllm.sampling_params import MAX_CLIENT_CHARS


def test_priority_and_user_become_the_requests_priority_and_client():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], priority=-3, user="alice")
    params = sampling_params(chat, 8, None)
    assert (params.priority, params.client) == (-3, "alice")
    plain = sampling_params(CompletionRequest(prompt="hi"), 8, None)
    assert (plain.priority, plain.client) == (0, None)
    long = sampling_params(CompletionRequest(prompt="hi", user="u" * 1000), 8, None)
    assert long.client == "u" * MAX_CLIENT_CHARS


def test_priority_must_be_an_integer():
    for bad in (1.5, "2", True):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="hi", priority=bad)


# ---- who the client is: the API key (of several), the X-Client-Id header, then `user` --------------------------------
def identity_app(api_keys: list[str]) -> TestClient:
    app = FastAPI()

    @app.post("/v1/who")
    async def who(req: CompletionRequest, raw: Request) -> dict:
        return {"client": sampling_params(req, 8, None, client_of(raw)).client}

    app.add_middleware(ApiKeyMiddleware, api_key=api_keys)
    return TestClient(app)


def who(http, key: str | None = None, header: str | None = None, user: str | None = None):
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **({"X-Client-Id": header} if header else {})}
    response = http.post("/v1/who", json={"prompt": "hi", **({"user": user} if user else {})}, headers=headers)
    return response.json()["client"] if response.status_code == 200 else response.status_code


def test_with_several_keys_the_key_names_the_client_before_header_and_user():
    http = identity_app(["sk-alice-secret", "sk-bob-secret"])
    alice = who(http, "sk-alice-secret", header="mallory", user="mallory")
    assert alice == key_client("sk-alice-secret") and alice.startswith("key-") and "secret" not in alice
    assert who(http, "sk-bob-secret") == key_client("sk-bob-secret") != alice
    assert who(http, "sk-wrong") == 401 and who(http) == 401


def test_with_one_key_the_header_then_user_name_the_client():
    """One key is shared by every caller, so it names no one."""
    http, key = identity_app(["only-key"]), "only-key"
    assert who(http, key, header="bob", user="alice") == "bob"
    assert who(http, key, user="alice") == "alice"
    assert who(http, key) is None
    assert who(http, key, header="h" * 1000) == "h" * MAX_CLIENT_CHARS


def test_api_key_flag_takes_several_keys():
    parser = argparse.ArgumentParser()
    ServerConfig.add_cli_args(parser)
    server = ServerConfig.from_cli_args(parser.parse_args(["--api-key", "a", "--api-key", "b, c"]))
    assert server.api_keys == ["a", "b", "c"]
    assert ServerConfig.from_cli_args(parser.parse_args(["--api-key", "one"])).api_keys == ["one"]
    assert ServerConfig(api_key=None).api_keys == []
