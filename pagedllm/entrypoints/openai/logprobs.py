"""Token logprobs in OpenAI's two formats: the legacy one of /v1/completions and the chat one. JSON has no -inf, so
a logprob is clamped at MIN_LOGPROB (vLLM clamps the same way)."""

from __future__ import annotations

import math

from pagedllm.entrypoints.openai.protocol import ChatLogprobEntry, ChatLogprobs, CompletionLogprobs, TopLogprob
from pagedllm.outputs import CompletionOutput, Logprob

MIN_LOGPROB = -9999.0


def clamp(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def token_text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def by_rank(entry: dict[int, Logprob]) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else math.inf)


def completion_logprobs(c: CompletionOutput, start: int, text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy format for tokens `start:` of the output; top_logprobs: the top-k and the chosen."""
    out = CompletionLogprobs()
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=True):
        chosen = entry[token]
        out.tokens.append(token_text(chosen))
        out.token_logprobs.append(clamp(chosen.logprob))
        out.top_logprobs.append({token_text(lp): clamp(lp.logprob) for lp in by_rank(entry)})
        out.text_offset.append(text_offset)
        text_offset += len(token_text(chosen))
    return out


def top_logprob(lp: Logprob) -> TopLogprob:
    return TopLogprob(token=token_text(lp), logprob=clamp(lp.logprob), bytes=list(token_text(lp).encode()))


def chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> ChatLogprobs:
    """OpenAI's chat format: per token its logprob and bytes, and the top_n alternatives by rank."""
    content = []
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=True):
        tops = [top_logprob(lp) for lp in by_rank(entry)[:top_n]]
        content.append(ChatLogprobEntry(**top_logprob(entry[token]).model_dump(), top_logprobs=tops))
    return ChatLogprobs(content=content)
