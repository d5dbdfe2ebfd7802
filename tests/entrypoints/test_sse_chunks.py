"""The streamed /v1/completions events built from a template are the bytes pydantic writes for the same response."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.protocol import CompletionChoice, CompletionResponse
from pagedllm.entrypoints.openai.serving import sse
from pagedllm.entrypoints.openai.serving_completion import TextChunks

EVERY_CHAR = "".join(map(chr, [*range(0x800), 0x2028, 0x2029, 0xFEFF, 0xFFFD, 0x1F600]))


@pytest.mark.parametrize(("index", "text", "finish_reason", "stop_reason"), [
    (0, " hello", None, None),
    (0, EVERY_CHAR, None, None),  # controls, quotes, backslashes, non-ASCII, line separators
    (3, "", "stop", 7),
    (1, "x", "stop", 'fin "é"\n'),
    (2, "a\tb", "length", None),
    (0, "", "abort", None),
])
def test_text_chunk_is_pydantics_event(index: int, text: str, finish_reason: str | None,
                                       stop_reason: int | str | None) -> None:
    request_id, created, model = 'cmpl-"quoted"\\', 1_700_000_000, "models/SmolLM2 é"
    expected = sse(CompletionResponse(id=request_id, created=created, model=model, choices=[
        CompletionChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason)]))
    assert TextChunks(request_id, created, model).text(index, text, finish_reason, stop_reason) == expected
