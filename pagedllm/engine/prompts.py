"""A prompt checked and tokenized against a model's vocabulary and context, by the engine and by the fronts that
tokenize before any engine sees the request (a replica pool's router, the Ray Serve ingress): one set of checks and
messages for all, importable without the engine's model code.
"""

from __future__ import annotations

from typing import Any

from pagedllm.errors import InvalidRequestError


def tokenize_prompt(tokenizer: Any, prompt: str | list[int], vocab_size: int, max_model_len: int) -> list[int]:
    """LLMEngine.tokenize_prompt without an engine (a router tokenizes before it picks a replica)."""
    max_chars = max_model_len * tokenizer.max_token_chars
    if isinstance(prompt, str) and len(prompt) > max_chars:
        raise InvalidRequestError(f"the prompt has {len(prompt)} characters: more than max_model_len "
                                  f"({max_model_len}) tokens can hold")
    try:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate, which the tokenizer cannot take
        raise InvalidRequestError(f"the prompt is not valid text: {e}") from None
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(f"the prompt has {len(ids)} tokens, but max_model_len is {max_model_len} (it must "
                                  "leave room for a generated token; set by --max-model-len, or by the KV cache's "
                                  "size: --kv-cache-memory, --num-blocks)")
    return ids
