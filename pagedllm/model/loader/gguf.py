"""GGUF files (llama.cpp's format): the container read directly, tensors renamed to Hugging Face's names and
dequantized once at load time; on request the 4-bit ones (Q4_0, Q4_1) also come out as stored, for the 4-bit matmul."""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from pagedllm.model.loader.common import LoadedModel, ModelConfig, Q4Weight, check_weights
from pagedllm.model.loader.gguf_blocks import FAST_TYPES, dequantize_blocks, q4_parts
from pagedllm.model.registry import gguf_family
from pagedllm.model.tokenizer import Tokenizer

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
LAYER_NAMES = {
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
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# GGUF metadata value types (gguf.GGUFValueType): struct formats of scalars, numpy dtypes of arrays
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                12: "<f8"}
STRING, ARRAY = 8, 9
Q4_TYPES = ("Q4_0", "Q4_1")


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its raw bytes (a view of the mapped file), ggml type and HF-order shape."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # HF / torch order (GGUF lists dimensions fastest first; reversed here)
    data: np.ndarray  # uint8 [rows, bytes per row]


@dataclass
class TensorInfo:
    """A tensor's entry in the file's table: dimensions fastest first, offset from the start of the data."""

    name: str
    dims: list[int]
    tensor_type: GGMLQuantizationType
    offset: int


# -- the container ---------------------------------------------------------------------------------------------


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Metadata (key -> Python value) and tensors of a GGUF file, without reading tensor data.

    A direct parse of the (simple, stable) container format: gguf.GGUFReader builds a numpy view per array
    element, which costs 2-4 s on the default model's 98k-string vocabulary; this takes ~0.1 s.
    """
    buf = map_file(path)
    try:
        cursor = Cursor(buf)
        n_tensors, n_kv = cursor.header()
        metadata = {}
        for _ in range(n_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.take("<I"))
        infos = [cursor.tensor_info() for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", 32))
        data_start = (cursor.pos + alignment - 1) // alignment * alignment
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from e
    return metadata, {info.name: tensor_view(buf, info, data_start, path) for info in infos}


def map_file(path: str) -> mmap.mmap:
    """The whole file, mapped read-only (tensor data stays on disk until a weight is dequantized)."""
    with open(path, "rb") as f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise ValueError(f"{path}: not a GGUF file (empty)") from e


class Cursor:
    """A read position in a mapped GGUF file, and the reads of its little-endian values."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def header(self) -> tuple[int, int]:
        """Check the magic and version; the number of tensors and of metadata keys."""
        if self.buf[:4] != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        self.pos = 4
        version = self.take("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        return self.take("<Q"), self.take("<Q")

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("string runs past the end of the file")
        return self.buf[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        """A metadata value of a GGUF value type: a scalar, a string or an array (numeric arrays in one read)."""
        if vtype in SCALAR_FORMATS:
            return self.take(SCALAR_FORMATS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type in ARRAY_DTYPES:
                items = np.frombuffer(self.buf, dtype=ARRAY_DTYPES[item_type], count=count, offset=self.pos)
                self.pos += items.nbytes
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")

    def tensor_info(self) -> TensorInfo:
        import gguf

        name = self.string()
        dims = [self.take("<Q") for _ in range(self.take("<I"))]
        return TensorInfo(name, dims, gguf.GGMLQuantizationType(self.take("<I")), self.take("<Q"))


def tensor_view(buf: mmap.mmap, info: TensorInfo, data_start: int, path: str) -> GGUFTensor:
    """A tensor's bytes as [rows, bytes per row], a view of the mapped file; a truncated file fails naming it."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[info.tensor_type]
    row_bytes = info.dims[0] // block_size * type_size
    rows = math.prod(info.dims[1:])
    start = data_start + info.offset
    if start + rows * row_bytes > len(buf):
        raise ValueError(f"{path}: tensor {info.name} runs past the end of the file (truncated?)")
    data = np.frombuffer(buf, dtype=np.uint8, count=rows * row_bytes, offset=start).reshape(rows, row_bytes)
    return GGUFTensor(info.name, info.tensor_type, tuple(reversed(info.dims)), data)


# -- the model -------------------------------------------------------------------------------------------------


def load_gguf(path: str, dtype: torch.dtype, keep_4bit: bool = False) -> LoadedModel:
    """Config, weights in `dtype` (HF names, HF row order) and tokenizer of a GGUF file; with keep_4bit, its
    Q4_0 / Q4_1 matrices as stored instead (q4_weights; the dense rows made by the build where a form needs them)."""
    config, tokenizer, tensors = gguf_config(path)
    weights, q4_weights = {}, {}
    for gguf_name, tensor in tensors.items():
        name = hf_name(gguf_name)
        if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        heads = permuted_heads(gguf_name, config)
        if keep_4bit and tensor.tensor_type.name in Q4_TYPES and len(tensor.shape) == 2:
            q, d, m = q4_rows(tensor, heads)
            q4_weights[name] = Q4Weight(q, d, -8 * d if m is None else m, q4_0=m is None)
        else:
            weights[name] = dequantize(tensor, heads, path).to(dtype)
    weights = check_weights(weights, config, path, q4_weights)
    name = os.path.splitext(os.path.basename(path))[0]
    return LoadedModel(config, weights, tokenizer, name, q4_weights)


def gguf_config(path: str) -> tuple[ModelConfig, Tokenizer, dict[str, GGUFTensor]]:
    """A file's config, tokenizer and tensor views (the file mapped, no tensor read)."""
    metadata, tensors = read_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    return config_from_gguf(metadata, tensors, tokenizer, path), tokenizer, tensors


def dequantize(tensor: GGUFTensor, heads: int, path: str) -> torch.Tensor:
    """A tensor as float32 (or as stored, for F16 / F32) in HF's shape and row order, owning its memory."""
    import gguf

    try:
        if tensor.tensor_type.name in FAST_TYPES:
            values = dequantize_blocks(tensor.data, tensor.tensor_type.name).reshape(tensor.shape)
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # F16 / F32: a view of the file
            values = torch.from_numpy(np.require(values, requirements=("C", "W"))).reshape(tensor.shape)
    except Exception as e:
        raise ValueError(f"{path}: cannot read tensor {tensor.name} ({tensor.tensor_type.name}): {e}") from e
    return unpermute_rows(values, heads).contiguous() if heads else values


def permuted_heads(gguf_name: str, config: ModelConfig) -> int:
    """The head count whose rows llama.cpp's converter permuted in this tensor (a Llama q or k projection), or 0."""
    if config.architecture != "LlamaForCausalLM":
        return 0
    if ".attn_q." in gguf_name:
        return config.num_attention_heads
    return config.num_key_value_heads if ".attn_k." in gguf_name else 0


def q4_rows(tensor: GGUFTensor, permuted_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A Q4_0 / Q4_1 matrix as stored (gguf_blocks.q4_parts: the 4-bit values, the scales, Q4_1's mins), in HF's
    row order."""
    parts = q4_parts(tensor.data, tensor.tensor_type.name)
    if not permuted_heads:
        return parts
    q, d, m = (None if a is None else unpermute_rows(a, permuted_heads).contiguous() for a in parts)
    return q, d, m


def config_from_gguf(
    metadata: dict[str, Any], tensors: dict[str, GGUFTensor], tokenizer: Tokenizer, path: str
) -> ModelConfig:
    """ModelConfig from the `<architecture>.*` metadata keys; an unsupported architecture fails first."""
    arch = metadata.get("general.architecture")
    family = gguf_family(arch, path)

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
    rope_theta = f32(get("rope.freq_base", 10000.0))
    return ModelConfig(
        architecture=family.architecture,
        vocab_size=int(metadata.get(f"{arch}.vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=family.qkv_bias,
        rope_scaling=gguf_rope_scaling(metadata, arch, tensors, rope_theta, head_dim, path),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=gguf_eos_ids(metadata, tokenizer),
    )


def gguf_eos_ids(metadata: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """The tokenizer's end-of-generation tokens, then the file's end-of-turn / end-of-message ones."""
    eos_ids = tokenizer.end_of_generation_ids()
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if metadata.get(key) is not None and metadata[key] not in eos_ids:
            eos_ids.append(int(metadata[key]))
    return eos_ids


def gguf_rope_scaling(
    metadata: dict[str, Any], arch: str, tensors: dict[str, GGUFTensor], rope_theta: float, head_dim: int, path: str
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
    if not np.allclose(llama3_freq_divisors(scaling, rope_theta, head_dim), stored, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs tensor does not match Llama 3 RoPE scaling; not supported")
    return scaling


def llama3_freq_divisors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores in `rope_freqs`: original frequency / llama3-scaled frequency."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    smooth = (old_len / wavelen - low) / (high - low)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < old_len / high, 1.0, divisors)
    return np.where(wavelen > old_len / low, factor, divisors)


def f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF one (None for tensors the model does not use, e.g. rope_freqs)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = LAYER_NAMES.get(m[2])
        return None if part is None else f"model.layers.{m[1]}.{part}.{m[3]}"
    base, _, suffix = gguf_name.rpartition(".")
    return f"{GLOBAL_NAMES[base]}.{suffix}" if base in GLOBAL_NAMES else None


def unpermute_rows(w: ArrayT, n_head: int) -> ArrayT:
    """Undo convert_hf_to_gguf.py's q/k row order (interleaved rotary pairs -> HF's rotate-half halves); a numpy
    array or a tensor (a tensor's result may be a view: .contiguous() it)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (HF -> GGUF); used to write GGUF files in tests."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
