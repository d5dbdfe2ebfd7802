"""LoRA adapters in the PEFT format (adapter_config.json + adapter_model.safetensors), checked against the base model:
every projection's A [r, in] and B [out, r] with its scale folded into B, in the model's dtype."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from pagedllm.errors import InvalidRequestError
from pagedllm.model.loader.common import ModelConfig

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
TENSOR_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"
                         r"\.lora_([AB])\.weight$")


class LoRALoadError(InvalidRequestError):
    """An adapter that cannot be served on this base: missing or corrupt files, an unsupported feature, a rank above
    --max-lora-rank, shapes of another model (HTTP 400)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, projection) -> (A [r, in], B [out, r] already scaled), projections of
    PROJECTIONS; those the adapter does not target are absent."""

    rank: int  # the largest rank of any projection
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def projection_shape(config: ModelConfig, projection: str) -> tuple[int, int]:
    """(out, in) of a projection of the base model."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i)}[
        projection]


def load_peft_adapter(path: str, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check an adapter folder; any problem raises LoRALoadError naming the file and what is wrong."""
    settings = read_adapter_config(path)
    ranks = [settings["r"], *(r for r in (settings.get("rank_pattern") or {}).values() if isinstance(r, int))]
    if max(ranks) > max_rank:  # refused before the weights are read: a client may name any folder
        raise LoRALoadError(f"{path}: rank {max(ranks)} exceeds max_lora_rank {max_rank}")
    tensors = read_adapter_tensors(path, max_file_bytes(config, max_rank))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = TENSOR_NAME.match(name)
        if match is None:
            raise LoRALoadError(f"{path}: tensor {name!r} is not a LoRA A/B of a q/k/v/o/gate/up/down projection "
                                "(embeddings, lm_head, biases, DoRA and modules_to_save are not supported)")
        layer, projection, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, projection), {})[which] = tensor
    adapter = LoRAAdapter(rank=0)
    for (layer, projection), pair in sorted(pairs.items()):
        a, b = checked_pair(path, config, max_rank, layer, projection, pair)
        module = f"model.layers.{layer}.{'self_attn' if projection in 'qkvo' else 'mlp'}.{projection}_proj"
        scale = lora_scale(settings, module, a.shape[0])
        adapter.weights[(layer, projection)] = (a.to(dtype).contiguous(), (b.double() * scale).to(dtype).contiguous())
        adapter.rank = max(adapter.rank, a.shape[0])
    if not adapter.weights:
        raise LoRALoadError(f"{path}: the adapter holds no LoRA weights")
    return adapter


def read_adapter_config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    try:
        with open(file) as f:
            settings = json.load(f)
    except FileNotFoundError:
        raise LoRALoadError(f"{path}: no adapter_config.json (not a PEFT adapter folder)") from None
    except (OSError, ValueError) as e:
        raise LoRALoadError(f"{file}: cannot read: {e}") from None
    if not isinstance(settings, dict):
        raise LoRALoadError(f"{file}: not a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"{file}: peft_type {settings.get('peft_type')!r} is not LORA")
    if settings.get("use_dora"):
        raise LoRALoadError(f"{file}: DoRA adapters are not supported")
    if settings.get("bias", "none") != "none":
        raise LoRALoadError(f"{file}: LoRA biases (bias={settings.get('bias')!r}) are not supported")
    if settings.get("modules_to_save"):
        raise LoRALoadError(f"{file}: modules_to_save {settings['modules_to_save']!r} are not supported")
    if not isinstance(settings.get("r"), int) or not isinstance(settings.get("lora_alpha"), (int, float)):
        raise LoRALoadError(f"{file}: needs integer r and numeric lora_alpha")
    return settings


def max_file_bytes(config: ModelConfig, max_rank: int) -> int:
    """The largest adapter file this model can take: every projection of every layer at max_rank in fp64, plus 1 MiB
    of header; a bigger file is refused unread."""
    per_layer = sum(sum(projection_shape(config, p)) for p in PROJECTIONS)
    return config.num_hidden_layers * per_layer * max_rank * 8 + (1 << 20)


def read_adapter_tensors(path: str, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        other = " (adapter_model.bin is not read: save with safe_serialization)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoRALoadError(f"{path}: no adapter_model.safetensors{other}")
    if max_bytes is not None and os.path.getsize(file) > max_bytes:
        raise LoRALoadError(f"{file}: {os.path.getsize(file)} bytes, more than an adapter of this model at "
                            f"max_lora_rank can hold ({max_bytes})")
    try:
        return {name: t.float() for name, t in load_file(file).items()}
    except Exception as e:  # safetensors raises its own error types for corrupt or truncated files
        raise LoRALoadError(f"{file}: cannot read safetensors file: {e}") from None


def checked_pair(path: str, config: ModelConfig, max_rank: int, layer: int, projection: str,
                 pair: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B of one projection, shaped for this base model."""
    where = f"{path}: layer {layer} {projection}_proj"
    if set(pair) != {"A", "B"}:
        raise LoRALoadError(f"{where}: has lora_{''.join(pair)} without its pair")
    if layer >= config.num_hidden_layers:
        raise LoRALoadError(f"{where}: the base model has {config.num_hidden_layers} layers")
    a, b = pair["A"], pair["B"]
    out_features, in_features = projection_shape(config, projection)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
            or a.shape[0] != b.shape[1]:
        raise LoRALoadError(f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base model's "
                            f"projection [{out_features}, {in_features}] (an adapter of another model?)")
    if a.shape[0] > max_rank:
        raise LoRALoadError(f"{where}: rank {a.shape[0]} exceeds max_lora_rank {max_rank}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoRALoadError(f"{where}: holds NaN or infinite values")
    return a, b


def lora_scale(settings: dict, module: str, rank: int) -> float:
    """PEFT's scaling: lora_alpha / r, or / sqrt(r) with rsLoRA; rank_pattern / alpha_pattern keys match a module
    name's suffix, as PEFT matches them (the rank itself is read from the tensors)."""
    alpha = settings["lora_alpha"]
    for key, value in (settings.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
