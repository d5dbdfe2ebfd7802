"""What every loader gives back: a `ModelConfig`, weights under Hugging Face's Llama names checked against the shapes
the config implies, and the tokenizer; one form whatever the file, so the model code knows no file format."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.model.loader.gguf_blocks import q4_values
from pagedllm.model.registry import family_of
from pagedllm.model.tokenizer import Tokenizer

ROPE_TYPES = ("llama3",)  # besides plain RoPE (rope_scaling None); what layers.rope_inv_freq implements


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder, as the model code needs it."""

    architecture: str  # a registry.SUPPORTED_ARCHITECTURES name: "LlamaForCausalLM" | "MistralForCausalLM" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have biases (Qwen2)
    rope_scaling: dict | None  # None, or an HF dict with "rope_type": "llama3"
    bos_token_id: int | None
    eos_token_ids: list[int]

    def __post_init__(self) -> None:
        family_of(self.architecture)  # an unsupported one raises, naming the supported ones
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_TYPES:
            supported = ", ".join(("none", *ROPE_TYPES))
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling!r}; supported types: {supported}")


@dataclass
class Q4Weight:
    """A GGUF Q4_0 / Q4_1 weight as stored: w = q * scale + min, one scale and min per 32 inputs, both fp16 values."""

    q: torch.Tensor  # uint8 [out, in], values 0-15
    scale: torch.Tensor  # float32 [out, in / 32]
    min: torch.Tensor  # float32 [out, in / 32]
    q4_0: bool = False  # stored as Q4_0: scale * (q - 8), min holding -8 * scale for the kernel

    def values(self) -> torch.Tensor:
        """float32 [out, in], as the file's dequantization rounds them: made only where a form needs the dense rows
        (the 4-bit kernel alone does not: 0.14 s of the default model's load on Zen 3 went to rows no form read)."""
        return q4_values(self.q, self.scale, None if self.q4_0 else self.min)


@dataclass
class LoadedModel:
    """Everything an engine needs from a checkpoint."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names, in the requested dtype; no lm_head.weight when tied
    tokenizer: Tokenizer
    name: str
    # HF names; only when asked for (keep_4bit), and then not in `weights` (their dense rows: Q4Weight.values)
    q4_weights: dict[str, Q4Weight] = field(default_factory=dict)

    def nbytes(self) -> int:
        """The bytes of its tensors as loaded (plain and 4-bit)."""
        plain = sum(t.nbytes for t in self.weights.values())
        return plain + sum(w.q.nbytes + w.scale.nbytes + w.min.nbytes for w in self.q4_weights.values())


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape; the loader checks checkpoints against this."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str,
                  q4_weights: dict[str, Q4Weight] | None = None) -> dict[str, torch.Tensor]:
    """Keep exactly the expected tensors (those in `q4_weights` count as there); fail naming the first missing or
    misshapen one."""
    stored = {name: tuple(w.q.shape) for name, w in (q4_weights or {}).items()}
    checked = {}
    for name, shape in expected_shapes(config).items():
        found = tuple(weights[name].shape) if name in weights else stored.get(name)
        if found is None:
            raise ValueError(f"{source}: missing tensor {name}")
        if found != shape:
            raise ValueError(f"{source}: tensor {name} has shape {found}, expected {shape}")
        if name in weights:
            checked[name] = weights[name]
    return checked
