"""Tokenizer from GGUF metadata vs transformers' GGUF tokenizer; chat template; incremental detokenizer."""

from __future__ import annotations

import os
import random

import gguf
import numpy as np
import pytest
from conftest import smollm2_gguf_metadata

from pagedllm.model.loader import default_model_path
from pagedllm.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. Don't you think it's GREAT? I'M sure they'll agree.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Ünïcödé àccents, Ελληνικά, русский, العربية, עברית, हिन्दी",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\nand   runs      of     spaces",
    "numbers 1234567890 3.14159 -42 1e-5 2024-01-01",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special tokens inline<|endoftext|>and <file_sep> and <|im_end|>",
    "",
    " ",
    "\n",
    "a" * 300,
    "!!!???...,,,;;;:::",
    "https://example.com/path?query=1&b=2#frag",
    "combining e\u0301 and zero\u200bwidth and \U0001d11e music",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm2_gguf_metadata())


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' tokenizer built from the same GGUF file."""
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# -- building and basic properties ----------------------------------------------------------------------


def test_gguf_tokenizer_properties(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (1, 2, False)
    assert tok.id_to_token(1) == "<|im_start|>" and tok.id_to_token(2) == "<|im_end|>"
    assert all(tok.is_special(i) for i in range(17)) and not tok.is_special(17) and not tok.is_special(1000)
    assert tok.end_of_generation_ids() == [2, 0]
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_saved_tokenizer_folder_is_the_same(tok, tiny_model_dir):
    loaded = Tokenizer.from_dir(tiny_model_dir)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos) == (1, 2, False)
    assert loaded.chat_template == tok.chat_template and loaded.vocab_size == tok.vocab_size
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text), text


def test_special_tokens_match_whole(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids) == "user\nhi"


def test_digits_are_split(tok):
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


def test_roundtrip(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text, text


def test_add_bos_and_eos():
    metadata = dict(smollm2_gguf_metadata())
    metadata["tokenizer.ggml.add_bos_token"] = True
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.add_bos and tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    metadata["tokenizer.ggml.add_eos_token"] = True
    ids = Tokenizer.from_gguf_metadata(metadata).encode("hi")
    assert ids[0] == 1 and ids[-1] == 2


def test_bos_from_tokenizer_config(tiny_model_dir, tmp_path):
    """A folder whose tokenizer_config.json says add_bos_token gets BOS even if tokenizer.json lacks it."""
    import json
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model_dir, f), tmp_path)
    with open(tmp_path / "tokenizer_config.json") as f:
        config = json.load(f)
    config["add_bos_token"] = True
    config.pop("chat_template")
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.add_bos and tok.encode("hi")[0] == 1
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_a_folder_is_read_once_until_its_files_change(tiny_model_dir, tmp_path):
    """Engine after engine on one folder shares one Tokenizer; a changed (or added) file is read again."""
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model_dir, f), tmp_path)
    first = Tokenizer.from_dir(str(tmp_path))
    assert Tokenizer.from_dir(str(tmp_path) + "/") is first  # the same folder, spelled differently
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    changed = Tokenizer.from_dir(str(tmp_path))
    assert changed is not first and changed.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    os.remove(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(str(tmp_path))


def test_errors(tok):
    metadata = dict(smollm2_gguf_metadata())
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="'mystery'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "mystery"})
    no_template = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": None})
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir("/nonexistent-folder")


# -- against transformers' GGUF tokenizer -----------------------------------------------------------------


@pytest.mark.slow
def test_encode_matches_transformers(tok, hf_tok):
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text), text
        plain = hf_tok.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == plain, text


@pytest.mark.slow
def test_decode_matches_transformers(tok, hf_tok):
    rng = random.Random(0)
    sequences = [tok.encode(text) for text in TEXTS]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    for ids in sequences:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "2+2?"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    if len(messages) == 1 and add_generation_prompt:
        assert ours == (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
            "<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        )


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    """A toy sentencepiece (`tokenizer.ggml.model == "llama"`) vocabulary without merges: byte fallback,
    merges rebuilt from scores, Metaspace prefix; same ids and text as transformers' GGUF tokenizer."""
    from transformers import AutoTokenizer

    pieces = ["\u2581the", "\u2581a", "\u2581is", "th", "he", "in", "\u2581t", "\u2581i", "is", "an"]
    pieces.append("\u2581")
    pieces += list("abcdefghijklmnopqrstuvwxyzT.,!")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    path = str(tmp_path / "sp.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [("add_block_count", 1), ("add_context_length", 64), ("add_embedding_length", 8),
                       ("add_feed_forward_length", 16), ("add_head_count", 2), ("add_head_count_kv", 2),
                       ("add_layer_norm_rms_eps", 1e-5)]:
        getattr(writer, add)(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    from pagedllm.model.loader import read_gguf

    tok = Tokenizer.from_gguf_metadata(read_gguf(path)[0])
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    assert tok.add_bos and tok.bos_token_id == 1
    for text in ["the thin", "This is an ant.", "  leading", "héllo 😀 wörld", "the</s>is", "T", "Tthe,the!"]:
        assert tok.encode(text) == hf.encode(text), text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
        deltas = _stream(tok, [], ids, [1] * len(ids))
        assert "".join(deltas) == tok.decode(ids) and "\ufffd" not in "".join(deltas), text
    # the first output token's leading space survives after a prompt, even after skipped special tokens
    prompt, out = tok.encode("the"), [2] + tok.encode("is a thin", add_special_tokens=False)
    assert "".join(_stream(tok, prompt, out, [1] * len(out))) == " is a thin"


# -- incremental detokenization ---------------------------------------------------------------------------


def _stream(
    tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int], skip: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    for size in chunks:
        deltas.append(detok.step(ids[i : i + size]))
        i += size
    deltas.append(detok.step(ids[i:]))
    assert detok.text == "".join(deltas)
    return deltas


def test_detokenizer_matches_decode(tok):
    rng = random.Random(0)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say something."}]))
    for text in TEXTS:
        ids = tok.encode(text)
        for chunks in ([1] * len(ids), [rng.randrange(1, 4) for _ in range(len(ids) // 2)]):
            for skip in (True, False):
                for p in (prompt, []):
                    deltas = _stream(tok, p, ids, chunks, skip)
                    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), text
                    assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_detokenizer_holds_back_split_characters(tok):
    text = "😀👍🏽 中文 🇫🇷"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters span several tokens
    deltas = _stream(tok, [], ids, [1] * len(ids))
    assert "" in deltas and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_keeps_leading_space_after_prompt(tok):
    prompt = tok.encode("Hello")
    out = tok.encode(" world, again")
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.step(out[:1]) == " world"
    assert detok.step(out[1:]) + detok.flush() == ", again"
    assert detok.text == " world, again"


def test_detokenizer_flush_emits_unfinished_character(tok):
    ids = tok.encode("ok 😀")[:-1]  # generation stopped inside the emoji
    assert tok.decode(ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        detok.step([i])
    assert detok.text.startswith("ok") and "\ufffd" not in detok.text
    detok.flush()
    assert detok.text == tok.decode(ids) and detok.flush() == ""


def test_detokenizer_window_stays_short(tok):
    ids = tok.encode(" ".join(TEXTS) * 5)
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        detok.step([i])
        assert len(detok.ids) - detok.prefix_offset <= 12  # O(1) work per token, not O(length)
    assert detok.text == tok.decode(ids)


def test_detokenizer_special_tokens_only(tok):
    ids = [1, 2, 0] * 50 + tok.encode(" done")
    deltas = _stream(tok, [], ids, [1] * len(ids))
    assert "".join(deltas) == " done"
    deltas = _stream(tok, [], ids, [1] * len(ids), skip=False)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)
