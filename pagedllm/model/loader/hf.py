"""Hugging Face model folders: config.json (+ generation_config.json), safetensors weights (one file or sharded with an
index) and the tokenizer files."""

from __future__ import annotations

import os

import torch

from pagedllm.model.loader.common import LoadedModel, ModelConfig, check_weights, expected_shapes
from pagedllm.model.registry import ModelFamily, hf_family
from pagedllm.model.tokenizer import Tokenizer, read_json


def load_hf_folder(path: str, dtype: torch.dtype) -> LoadedModel:
    """Config, weights in `dtype` and tokenizer of a folder; an unsupported family fails first, on its config alone."""
    config, tokenizer = hf_folder_config(path)
    weights = read_safetensors(path, set(expected_shapes(config)), dtype)
    weights = check_weights(weights, config, path)
    return LoadedModel(config, weights, tokenizer, os.path.basename(os.path.normpath(path)))


def hf_folder_config(path: str) -> tuple[ModelConfig, Tokenizer]:
    """A folder's config and tokenizer, no weight read."""
    hf_config = read_json(os.path.join(path, "config.json"))
    if hf_config is None:
        raise FileNotFoundError(f"no config.json in model folder {path}")
    family = hf_family(hf_config.get("architectures") or [], hf_config.get("model_type"), path)
    generation_config = read_json(os.path.join(path, "generation_config.json")) or {}
    tokenizer = Tokenizer.from_dir(path)
    return config_from_hf(hf_config, generation_config, tokenizer, family, path), tokenizer


def config_from_hf(cfg: dict, generation_config: dict, tokenizer: Tokenizer, family: ModelFamily,
                   path: str) -> ModelConfig:
    """ModelConfig from config.json (transformers 4.x and 5.x spellings of RoPE settings)."""
    check_hf_features(cfg, family, path)
    try:
        heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = hf_rope(cfg)
        return ModelConfig(
            architecture=family.architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family.qkv_bias,
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id", tokenizer.bos_token_id),
            eos_token_ids=hf_eos_ids(cfg, generation_config, tokenizer),
        )
    except KeyError as e:
        raise ValueError(f"{path}/config.json: missing key {e.args[0]!r}") from e
    except ValueError as e:
        raise ValueError(f"{path}/config.json: {e}") from e


def check_hf_features(cfg: dict, family: ModelFamily, path: str) -> None:
    """Refuse what the decoder does not implement: biases a family does not have, sliding-window attention."""
    if cfg.get("mlp_bias") or (not family.qkv_bias and cfg.get("attention_bias")):
        raise ValueError(f"{path}: Llama/Mistral attention_bias or mlp_bias checkpoints are not supported")
    if cfg.get("use_sliding_window") or (family.architecture == "MistralForCausalLM" and cfg.get("sliding_window")):
        raise ValueError(f"{path}: sliding-window attention is not supported")


def hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """RoPE theta and scaling (None for plain RoPE); transformers 5.x keeps both in `rope_parameters`."""
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        rope_scaling.setdefault("rope_type", rope_scaling.pop("type", None))
        if rope_scaling["rope_type"] == "default":
            rope_scaling = None
    return rope_theta, rope_scaling


def hf_eos_ids(cfg: dict, generation_config: dict, tokenizer: Tokenizer) -> list[int]:
    """generation_config.json's end tokens (else config.json's), then the tokenizer's other end-of-generation ones."""
    eos = generation_config.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    for token_id in tokenizer.end_of_generation_ids():
        if token_id not in eos_ids:
            eos_ids.append(token_id)
    return eos_ids


def read_safetensors(path: str, wanted: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read the wanted tensors from a folder's *.safetensors (single file or sharded with an index)."""
    from safetensors import safe_open

    index = read_json(os.path.join(path, "model.safetensors.index.json"))
    if index is not None:
        files = sorted(set(index["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
    weights = {}
    for file in files:
        file_path = os.path.join(path, file)
        if not os.path.isfile(file_path):
            raise FileNotFoundError(f"weight shard listed in the index does not exist: {file_path}")
        try:
            with safe_open(file_path, framework="pt") as f:
                for name in f.keys():
                    if name in wanted:
                        weights[name] = f.get_tensor(name).to(dtype)
        except Exception as e:  # safetensors raises its own error types for corrupt/truncated files
            raise ValueError(f"{file_path}: cannot read safetensors file: {e}") from e
    return weights
