"""Shared fixtures: tiny random Llama / Qwen2 checkpoints (HF folders, GGUF) with the real SmolLM2 tokenizer.

The models are random but initialised with a large std (0.1), with random norm weights and biases, so that
greedy decoding wanders over many tokens instead of repeating one, and every tensor matters.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import numpy as np
import pytest
import torch

TINY_VOCAB = 49152  # the SmolLM2 tokenizer's
TINY_SEED = 0


@functools.lru_cache(maxsize=1)
def smollm2_gguf_metadata() -> dict:
    """Metadata of the default SmolLM2 GGUF (tokenizer, chat template, ...), read once per session."""
    from pagedllm.model.loader import default_model_path, read_gguf

    metadata, _ = read_gguf(default_model_path())
    return metadata


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give norm weights and biases random values too (transformers initialises them to 1 and 0)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_tiny_hf_model(path: str, architecture: str = "LlamaForCausalLM", **overrides) -> str:
    """Save a tiny random model made by transformers (float32 safetensors) plus the SmolLM2 tokenizer."""
    import transformers

    from pagedllm.model.tokenizer import Tokenizer

    config_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
    }
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=1,  # <|im_start|>, as the SmolLM2 GGUF says
        eos_token_id=2,  # <|im_end|>
    )
    kwargs.update(overrides)
    config = config_class[architecture](**kwargs)
    torch.manual_seed(TINY_SEED)
    model = getattr(transformers, architecture)(config).eval()
    _randomize(model, TINY_SEED)
    model.save_pretrained(path, safe_serialization=True)
    Tokenizer.from_gguf_metadata(smollm2_gguf_metadata()).save(path)
    return path


def write_gguf(model_dir: str, gguf_path: str, extra_tensors: dict[str, np.ndarray] | None = None,
               quant: str | None = None) -> str:
    """Write an HF folder made by make_tiny_hf_model as a GGUF file, the way llama.cpp's converter does:
    its tensor names, F32 data, q/k rows permuted for Llama, its metadata keys and the tokenizer metadata.
    `extra_tensors` are added under their GGUF names (e.g. rope_freqs.weight). `quant` ("Q4_0", "Q4_1", ...)
    quantizes the layers' projection weights with gguf's own quantizer, as llama-quantize would."""
    import gguf
    from safetensors.numpy import load_file

    from pagedllm.model.loader import permute_rows

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = {"llama": "llama", "qwen2": "qwen2"}[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))

    writer = gguf.GGUFWriter(gguf_path, arch)
    writer.add_name(os.path.basename(model_dir))
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    meta = smollm2_gguf_metadata()
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(meta["tokenizer.chat_template"])

    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, array in tensors.items():
        if name.startswith("model.layers."):
            _, _, n, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{n}.{names[module]}.{suffix}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if arch == "llama" and ".attn_q." in gguf_name:
            array = permute_rows(array, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            array = permute_rows(array, kv_heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if quant and gguf_name.startswith("blk.") and gguf_name.endswith(".weight") and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    for gguf_name, array in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HF folder: tiny random LlamaForCausalLM (hidden 64, 2 layers, 4 heads, 2 kv heads, untied lm_head,
    vocab 49152), float32 safetensors, SmolLM2 tokenizer.json and chat template."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir: str):
    """The tiny Llama loaded by transformers (float32), the reference the engine is compared with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HF folder: tiny random Qwen2ForCausalLM with q/k/v biases, otherwise shaped like tiny_model_dir
    (untied lm_head: tied random embeddings make greedy decoding repeat the input token)."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny-qwen2")), "Qwen2ForCausalLM")


@pytest.fixture(scope="session")
def tiny_gguf_path(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama of tiny_model_dir as an F32 GGUF file written like llama.cpp's converter."""
    return write_gguf(tiny_model_dir, str(tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"))


def make_peft_adapter(base_dir: str, path: str, seed: int, r: int = 8, lora_alpha: float = 16,
                      targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"), use_rslora: bool = False) -> str:
    """A random LoRA adapter for the model in `base_dir`, made and saved by PEFT itself (lora_B randomized: PEFT
    initialises it to zero, an adapter that changes nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(targets),
                                            use_rslora=use_rslora, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return path


def peft_reference_model(base_dir: str, adapter_dir: str):
    """transformers + PEFT with the adapter merged into the weights: the reference an adapter's outputs must equal."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


FAKE_GFLOPS, FAKE_COPY_GBPS = 100.0, 10.0  # fake_machine's speeds


def fake_peak(dtype_name: str) -> dict[str, float]:
    return {f"{dtype_name}_gflops": FAKE_GFLOPS, "copy_gbps": FAKE_COPY_GBPS}


@contextlib.contextmanager
def faked_machine(folder: Path) -> Iterator[None]:
    """The bench commands' machine-limit estimates take fake speeds, cached in `folder`: no test measures this
    machine (seconds of matmuls) or puts fake speeds in the user's cache. The kernel tables stay where they are
    (measuring them in every test would cost seconds each)."""
    from pagedllm.bench import roofline
    from pagedllm.model import machine_cache

    real = machine_cache.cache_file

    def cache_file(key: dict[str, str], prefix: str = "kernels") -> Path:
        return folder / real(key, prefix).name if prefix == roofline.MACHINE_CACHE else real(key, prefix)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(machine_cache, "cache_file", cache_file)
        mp.setattr(roofline, "measure_peak", fake_peak)
        yield


@pytest.fixture
def fake_machine(tmp_path):
    with faked_machine(tmp_path):
        yield


# Seconds a server test's client keeps an idle connection for its next request: below the server's keep-alive
# (--timeout-keep-alive, 5 s), so that no request goes out on a connection the server is closing at that moment.
# httpx keeps them 5 s too, and a client that does not retry lost a request to that race in a clean-clone CI run.
CLIENT_KEEPALIVE_S = 2.0
Client = TypeVar("Client")


def no_retry_client(sdk: type[Client], base_url: str, **kwargs: object) -> Client:
    """A client of an official SDK's class (openai.OpenAI, openai.AsyncOpenAI, anthropic.Anthropic) that does not
    retry, so that a request the server lost fails its test, and reuses its connections only while the server keeps
    them."""
    module = __import__(sdk.__module__.split(".")[0])
    http = module.DefaultAsyncHttpxClient if sdk.__name__.startswith("Async") else module.DefaultHttpxClient
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=CLIENT_KEEPALIVE_S)
    return sdk(base_url=base_url, max_retries=0, http_client=http(limits=limits), **kwargs)
