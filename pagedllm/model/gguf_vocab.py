"""A GGUF file's vocabulary rebuilt as a `tokenizers` backend, the way llama.cpp and transformers' GGUF converter read
it: byte-level BPE (split into words as its `tokenizer.ggml.pre` type says) or sentencepiece BPE with byte fallback,
with its control and user-defined tokens. Kept apart from tokenizer.py, which wraps any backend for the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp token types (tokenizer.ggml.token_type)
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp and transformers' GGUF
# converter define them. None means GPT-2's own regex (ByteLevel with use_regex=True).
_GPT2 = None
_DIGITS_THEN_GPT2 = "digits"  # llama.cpp's STARCODER/SMOLLM family: every digit alone, then the GPT-2 regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def gguf_backend(metadata: Mapping[str, Any]) -> tuple[BackendTokenizer, bool]:
    """The backend a GGUF file's metadata (key -> Python value) describes, and whether its model type adds BOS by
    default (`tokenizer.ggml.add_bos_token` where given). Bos / eos and the post-processor are the caller's."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, merges, metadata.get("tokenizer.ggml.pre", "default"))
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
        backend = _sentencepiece_bpe(
            tokens,
            merges,
            scores,
            unk_token=None if unk_id is None else tokens[unk_id],
            add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
        )
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), "
            "'llama' (sentencepiece BPE)"
        )
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, token_type in zip(tokens, token_types, strict=True)
            if token_type in (_TOKEN_UNKNOWN, _TOKEN_CONTROL)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, token_type in zip(tokens, token_types, strict=True)
            if token_type == _TOKEN_USER_DEFINED
        ]
    )
    return backend, add_bos


def _byte_level_bpe(tokens: list[str], merges: list[tuple], pre: str) -> BackendTokenizer:
    """GPT-2 style byte-level BPE, split into words the way the vocabulary's `pre` type says."""
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(sorted(_PRE_TOKENIZER_SPLITS))}"
        )
    split = _PRE_TOKENIZER_SPLITS[pre]
    vocab = {token: i for i, token in enumerate(tokens)}
    # llama.cpp (and Llama 3's tokenizer.json) look a whole word up in the vocabulary before merging
    ignore_merges = split == _LLAMA3_SPLIT
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=ignore_merges)
    )
    if split is _GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str],
    merges: list[tuple],
    scores: Sequence[float] | None,
    unk_token: str | None,
    add_space_prefix: bool,
) -> BackendTokenizer:
    """Sentencepiece BPE with byte fallback (Llama 2, Mistral); merges from the file or from scores."""
    vocab = {token: i for i, token in enumerate(tokens)}
    if not merges:
        if scores is None:
            raise ValueError("sentencepiece GGUF tokenizer has neither merges nor scores")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge; better-scored results merge first (as in HF)."""
    merges = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
