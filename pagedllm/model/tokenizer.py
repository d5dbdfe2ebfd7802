"""Tokenizer: text <-> token ids, the chat template, and incremental detokenization for streaming.

Wraps a Hugging Face fast tokenizer (`tokenizers.Tokenizer`), built either from a model folder's
`tokenizer.json` or from the vocabulary a GGUF file carries in its metadata (llama.cpp's key names; gguf_vocab.py).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from pagedllm.model.gguf_vocab import gguf_backend

if TYPE_CHECKING:
    import jinja2

# Control tokens that end a turn; llama.cpp treats them as end-of-generation by their text.
_END_OF_GENERATION_TEXTS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>",
)

# Texts longer than this are encoded by encode_batch, which releases the GIL (see Tokenizer.encode)
LONG_TEXT_CHARS = 4096

# How many prompt tokens the detokenizer decodes with the first output token (as vLLM), so that the first
# token's leading space and multi-token characters spanning the prompt boundary come out right.
_INITIAL_WINDOW = 5


class Tokenizer:
    """Text <-> ids with the model's special tokens, and its chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos: bool,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self._template: jinja2.Template | None = None
        self._max_token_chars: int | None = None

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) from a model folder; once per
        process while those files are unchanged (parsing tokenizer.json takes 0.1-0.2 s, paid at every engine build
        by a process that builds several: a bench sweep, the tests). A Tokenizer is not changed after it is made."""
        stamps = tuple(_stamp(os.path.join(path, name)) for name in _FOLDER_FILES)
        return _folder_tokenizer(os.path.realpath(path), stamps)

    @classmethod
    def _read_dir(cls, path: str) -> Tokenizer:
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in model folder {path}")
        try:
            backend = BackendTokenizer.from_file(tokenizer_file)
        except Exception as e:
            raise ValueError(f"cannot read tokenizer {tokenizer_file}: {e}") from e
        config = read_json(os.path.join(path, "tokenizer_config.json")) or {}

        bos_token_id = _token_id(backend, config.get("bos_token"))
        eos_token_id = _token_id(backend, config.get("eos_token"))
        chat_template = _chat_template(config.get("chat_template"))
        template_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                chat_template = f.read()

        # tokenizer.json's post-processor decides whether BOS is added; honour an explicit add_bos_token too.
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_token_id is not None and len(probe) > 1 and probe[0] == bos_token_id
        if config.get("add_bos_token") and bos_token_id is not None and not add_bos:
            _set_post_processor(backend, bos_token_id, add_bos=True, eos_token_id=None, add_eos=False)
            add_bos = True
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            chat_template=chat_template,
            add_bos=add_bos,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes, from its metadata (key -> Python value).

        Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and sentencepiece BPE (`"llama"`) are supported,
        the way llama.cpp and transformers' GGUF converter read them.
        """
        backend, add_bos = gguf_backend(metadata)
        bos_token_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_token_id = metadata.get("tokenizer.ggml.eos_token_id")
        add_bos = add_bos and bos_token_id is not None
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_token_id is not None
        _set_post_processor(backend, bos_token_id, add_bos, eos_token_id, add_eos,
                            byte_level=metadata.get("tokenizer.ggml.model") == "gpt2")
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            chat_template=metadata.get("tokenizer.chat_template"),
            add_bos=add_bos,
        )

    def save(self, path: str) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template) into folder `path`."""
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    # -- use -----------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens in the text are matched whole. BOS added if the model wants.
        A long text goes through encode_batch, which releases the GIL while it works (encode holds it), so a
        server thread tokenizing it does not stall the event loop."""
        if len(text) > LONG_TEXT_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string, at least its decoded text): a text
        longer than n times this has more than n tokens."""
        if self._max_token_chars is None:
            longest = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
            # a normalizer may shorten the text first (NFC composes pairs); allow for it
            self._max_token_chars = longest * (1 if self.backend.normalizer is None else 4)
        return self._max_token_chars

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """Whether the token is a special/control token (skipped by decode(skip_special_tokens=True))."""
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def end_of_generation_ids(self) -> list[int]:
        """EOS plus the special tokens that end a turn (e.g. <|im_end|>, <|endoftext|>), EOS first."""
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        for text in _END_OF_GENERATION_TEXTS:
            token_id = self.backend.token_to_id(text)
            if token_id is not None and token_id not in ids and self.is_special(token_id):
                ids.append(token_id)
        return ids

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to the prompt text the model was trained on (as transformers does)."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template; pass a plain prompt instead of chat messages"
            )
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id) or "",
            eos_token=self._token_text(self.eos_token_id) or "",
            **kwargs,
        )

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; never emits half of a multi-byte UTF-8 character
    (holds back while the decoded tail ends with U+FFFD), and gives the same total text as decode(all ids).

    Offsets as in vLLM/TGI: decode only a short window of earlier tokens plus the new ones and diff the
    two texts, so each step costs O(1) in the sequence length.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_INITIAL_WINDOW:])
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(self.ids)  # tokens before this are already in `text`
        self.text = ""

    def step(self, new_ids: list[int]) -> str:
        """Append `new_ids`; return the text they complete (may be "" while a character is unfinished)."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            # nothing visible yet (skipped special tokens), or an unfinished multi-byte character: keep the
            # window so the next token is decoded with real text before it (sentencepiece strips a leading
            # space at the start of a decode)
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character becomes U+FFFD); call when a sequence ends."""
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


# -- model folders -------------------------------------------------------------------------------------------

_FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _stamp(path: str) -> tuple[int, int] | None:
    """A file's size and modification time (None if absent): a changed file is read again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _folder_tokenizer(path: str, stamps: tuple[tuple[int, int] | None, ...]) -> Tokenizer:
    return Tokenizer._read_dir(path)


# -- building backends ---------------------------------------------------------------------------------------


def _set_post_processor(
    backend: BackendTokenizer,
    bos_token_id: int | None,
    add_bos: bool,
    eos_token_id: int | None,
    add_eos: bool,
    byte_level: bool = False,
) -> None:
    """Add BOS/EOS around every encoded text when the model expects them."""
    if not (add_bos or add_eos):
        backend.post_processor = processors.ByteLevel(trim_offsets=False) if byte_level else None
        return
    bos = [f"{backend.id_to_token(bos_token_id)}"] if add_bos else []
    eos = [f"{backend.id_to_token(eos_token_id)}"] if add_eos else []
    single = " ".join([*bos, "$A", *eos])
    pair = " ".join([*bos, "$A", *eos, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)])
    special = [(t, backend.token_to_id(t)) for t in {*bos, *eos}]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# -- chat template -------------------------------------------------------------------------------------------


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses (jinja2 imported here: its import,
    0.15 s, is not on the way to an engine's first plain prompt)."""
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"invalid chat template: {e}") from e


def _chat_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (take 'default')."""
    if value is None or isinstance(value, str):
        return value
    named = {t["name"]: t["template"] for t in value}
    return named.get("default", next(iter(named.values()), None))


def _token_id(backend: BackendTokenizer, token: Any) -> int | None:
    """Id of a special token given as text or as an AddedToken dict ({"content": ...}) in tokenizer_config."""
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def read_json(path: str) -> dict | None:
    """A JSON file's contents, None when it is absent, ValueError naming it when it is unreadable."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


__all__ = ["IncrementalDetokenizer", "Tokenizer"]
