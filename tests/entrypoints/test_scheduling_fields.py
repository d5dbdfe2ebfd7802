"""The HTTP API's scheduling fields reach the engine: `priority` (vLLM's extra) and `user` (OpenAI's, the client
the fair policy shares service between)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.serving import sampling_params
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
