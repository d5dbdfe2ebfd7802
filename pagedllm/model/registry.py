"""Which model class runs a checkpoint, by the architecture the checkpoint names (config.json's `architectures` or
`model_type`, a GGUF file's `general.architecture`). A new model family is one module beside `llama.py` and one line in
FAMILIES; the class is imported only when a model of its family is built, so the loader can ask this table first."""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from pagedllm.model.attention import AttentionRoute
    from pagedllm.model.dispatch import PlannedForms
    from pagedllm.model.llama import AttentionMetadata
    from pagedllm.model.loader import ModelConfig, Q4Weight
    from pagedllm.model.lora import LoRABatch, LoRAStack
    from pagedllm.model.sampler import GrammarMask


@dataclass(frozen=True)
class ModelFamily:
    """One architecture a checkpoint may name, and the class (`module:Class` under pagedllm.model) that runs it."""

    architecture: str  # config.json's `architectures` entry; ModelConfig.architecture
    model_type: str  # config.json's `model_type`, for configs that name no architecture
    gguf_architecture: str | None  # GGUF `general.architecture`; None when llama.cpp writes the family as another
    model_class: str
    qkv_bias: bool = False  # the q / k / v projections carry biases


FAMILIES = (
    ModelFamily("LlamaForCausalLM", "llama", "llama", "llama:LlamaModel"),  # Llama 2 / 3, SmolLM, TinyLlama
    ModelFamily("MistralForCausalLM", "mistral", None, "llama:LlamaModel"),  # llama.cpp writes it as "llama"
    ModelFamily("Qwen2ForCausalLM", "qwen2", "qwen2", "llama:LlamaModel", qkv_bias=True),
)
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)
GGUF_ARCHITECTURES = tuple(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)


class CausalLM(Protocol):
    """What the model runner asks of a model: a forward pass over the paged cache and the logits of its rows."""

    config: ModelConfig
    dtype: torch.dtype
    ext: ModuleType | None  # the C++ kernels; None on the reference path (then top_logits is not called)
    int8: frozenset[str]  # the matmuls that run w8a8 in large steps
    f16: bool  # the 4-bit weights may also run with fp16 products (AVX512-FP16; `--dtype auto`'s fp32, or bf16)
    q8: bool  # ... or against int8 activations (AVX512-VNNI or AVX2; `--dtype auto`'s fp32)
    lora: LoRAStack | None  # the resident LoRA adapters (the runner sets it with enable_lora)
    attention_route: AttentionRoute  # which attention kernel each sequence takes (the runner sets the measured one)

    @property
    def num_int4_matmuls(self) -> int: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora: LoRABatch | None = None,
                ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def top_logits(self, hidden: torch.Tensor, grammar: GrammarMask | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class CausalLMClass(Protocol):
    """A model family's class: built from the loader's config and weights."""

    def __call__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 attention_backend: str = "auto", q4_weights: dict[str, Q4Weight] | None = None,
                 int8: Collection[str] = (), planned: Mapping[str, PlannedForms] | None = None,
                 f16: bool = False, q8: bool = False) -> CausalLM: ...


def unsupported(found: object, source: str, supported: Collection[str] = SUPPORTED_ARCHITECTURES,
                what: str = "architecture") -> ValueError:
    """The error for a checkpoint of a family not in the table, naming the supported ones."""
    return ValueError(f"{source}: unsupported {what} {found!r}; supported: {', '.join(supported)}")


def family_of(architecture: str) -> ModelFamily:
    """The family of a ModelConfig.architecture."""
    for family in FAMILIES:
        if family.architecture == architecture:
            return family
    raise unsupported(architecture, "model config")


def hf_family(architectures: list[str], model_type: str | None, source: str) -> ModelFamily:
    """The family a config.json names: its first supported `architectures` entry, else its `model_type`."""
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return family_of(name)
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    raise unsupported(architectures or model_type, source)


def gguf_family(gguf_architecture: object, source: str) -> ModelFamily:
    """The family a GGUF file's `general.architecture` names."""
    for family in FAMILIES:
        if family.gguf_architecture and family.gguf_architecture == gguf_architecture:
            return family
    raise unsupported(gguf_architecture, source, GGUF_ARCHITECTURES, "GGUF architecture")


def model_class(architecture: str) -> CausalLMClass:
    """The class that runs an architecture, imported now."""
    module, _, name = family_of(architecture).model_class.partition(":")
    return getattr(importlib.import_module(f"pagedllm.model.{module}"), name)
