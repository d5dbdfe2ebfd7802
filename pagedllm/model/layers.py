"""The small layers of a Llama-family model: linear weights (packed bf16, 4-bit), RMSNorm, rotary embeddings, SwiGLU.
Numerics follow transformers'."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedllm.model import kernels
from pagedllm.model.weight_forms import Bf16Weight, Int4Weight, Int8Weight

# The static route's cut-offs (static_route), where the measured one (model/dispatch.py) is not set.
# Up to this many rows, a layer with 4-bit weights runs the int4 kernel instead of a bf16 matmul: a small batch is
# bound by reading the weights, and 4-bit weights are a third of bf16's bytes. From ~12 rows bf16_gemm (below) is as
# fast, and faster beyond (docs/performance.md: docs/scripts/int4_kernels.py).
INT4_MAX_ROWS = 8
# ... and up to this many where the weight has no bf16_gemm form (no AVX512-BF16 kernel, or an AMX CPU): against
# oneDNN's matmul the int4 kernel held its own up to 32 rows (docs/scripts/int4_rows.py).
INT4_MAX_ROWS_WITHOUT_BF16_GEMM = 32
# ... and up to this many in an fp32 model (csrc/int4_linear_f32.cpp against oneDNN's fp32 matmul on the Intel Xeon
# kind without AVX512-BF16, docs/performance.md): a sixth of the bytes, and 1.1-1.4x its speed from 32 to 1024 rows.
INT4_F32_MAX_ROWS = 1024
# Up to this many rows (and past INT4_MAX_ROWS when there is a 4-bit form), a bf16 layer runs the C++ bf16_gemm
# instead of oneDNN's packed matmul (docs/performance.md: docs/scripts/int4_kernels.py); from ~384 rows the two are
# within 3%, and oneDNN keeps the big (prefill) steps it has always run.
BF16_GEMM_MAX_ROWS = 256
Route = tuple[tuple[int, str], ...]  # (largest row count, path) pairs by rows; the last one takes every batch beyond
BIGGEST = 1 << 62  # the last leg of a route


def static_route(paths: frozenset[str], fp32: bool = False) -> Route:
    """The cut-offs tuned by hand (the module's constants; fp32: a weight of an fp32 model), for a weight whose
    measured route (model/dispatch.py) is not set: the 4-bit form for small batches, then int8, else bf16_gemm (not on
    AMX CPUs, whose tiles oneDNN's matmul uses), then oneDNN."""
    bf16 = "bf16_gemm" in paths and not kernels.cpu_has_amx()
    route: list[tuple[int, str]] = []
    if "int4" in paths:
        limit = INT4_F32_MAX_ROWS if fp32 else INT4_MAX_ROWS if bf16 else INT4_MAX_ROWS_WITHOUT_BF16_GEMM
        route.append((limit, "int4"))
    if paths & {"int8", "int8_mm"}:
        return (*route, (BIGGEST, "int8" if "int8" in paths else "int8_mm"))
    if bf16:
        route.append((BF16_GEMM_MAX_ROWS, "bf16_gemm"))
    return (*route, (BIGGEST, "onednn"))


def padded_rows(rows: int) -> int:
    """Bounded shapes: a row count rounded up to one of ~8 sizes per doubling (16 + 8 per octave up to the biggest
    step), so oneDNN's primitive cache holds a primitive for every size a step can have; at most 1/8 more rows."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class PackedWeight:
    """A linear layer's weight [out, in] packed once into oneDNN's blocked layout, with the other forms it may run
    as: the checkpoint's 4-bit form (Int4Weight), int8 (Int8Weight) and bf16_gemm's (Bf16Weight). F.linear on a plain
    weight repacks it on every call: measured here, packing once makes the decode step's matmuls 1.1-2x faster
    (most at batch 1). Only the packed copy is kept (widened, also the plain bf16 rows until the route drops them);
    a caller that needs the rows keeps the plain tensor itself.
    `route` says which form serves a batch of a given number of rows: measured on this machine (model/dispatch.py)
    once the engine sets it, else static_route's hand-tuned cut-offs. `pad_rows`: oneDNN runs on padded_rows rows.
    A bf16 weight on a CPU without native bf16 matmuls is packed `widened` to fp32 (see onednn_mm)."""

    def __init__(self, plain: torch.Tensor, int4: Int4Weight | None = None, int8: Int8Weight | None = None,
                 bf16: Bf16Weight | None = None, onednn: bool = True) -> None:
        """onednn=False: no oneDNN form (its route takes none: see skipped)."""
        self.pad_rows = False  # set by model/dispatch.py under PAGEDLLM_PAD_ROWS=1
        self.widened = self.widens(plain.dtype)
        packed = plain.float() if self.widened else plain
        self.packed: torch.Tensor | None = torch.ops.mkldnn._reorder_linear_weight(packed) if onednn else None
        # forms the weight could have had but were not made, the cached route taking none of them (llama.py)
        self.skipped: frozenset[str] = frozenset()
        # beside a widened copy, torch's own bf16 matmul on the plain rows: half the bytes, faster at 1-2 rows
        self.plain = plain if self.widened else None
        self.shape = tuple(plain.shape)  # [out, in]
        self.int4 = int4
        self.int8 = int8
        self.bf16 = bf16
        self.route = self.static_route()

    @staticmethod
    def available(dtype: torch.dtype) -> bool:
        """oneDNN is there to run this dtype (bf16 natively or widened)."""
        return torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)

    @staticmethod
    def native(dtype: torch.dtype) -> bool:
        """oneDNN runs this dtype's matmul natively (bf16 needs AVX512-BF16 or AMX)."""
        if not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    @classmethod
    def widens(cls, dtype: torch.dtype) -> bool:
        """A weight of this dtype is packed widened to fp32 (bf16 where oneDNN has no native bf16 matmul)."""
        return dtype == torch.bfloat16 and not cls.native(torch.bfloat16)

    def static_route(self) -> Route:
        return static_route(self.paths(), fp32=self.int4 is not None and self.int4.dtype == torch.float32)

    def paths(self) -> frozenset[str]:
        """The forms this weight can run as (dispatch's path names)."""
        int4 = self.int4
        forms = {"int4": int4 and int4.form, "int4_f16": int4 and int4.f16_scale, "int4_q8": int4 and int4.q8 or None,
                 "bf16_gemm": self.bf16,
                 "bf16_plain": self.plain}
        int8 = self.int8.forms() if self.int8 is not None else frozenset()
        onednn = frozenset({"onednn"}) if self.packed is not None else frozenset()
        return frozenset(name for name, form in forms.items() if form is not None) | int8 | onednn

    def entry(self) -> str:
        """Its shape and every form it could have (made or skipped): what a kernel table is measured for."""
        return self.shape_entry(self.shape, self.paths() | self.skipped)

    @staticmethod
    def shape_entry(shape: tuple[int, ...], forms: frozenset[str]) -> str:
        return f"{shape[0]}x{shape[1]}:{'+'.join(sorted(forms))}"

    def keep_only(self, paths: frozenset[str]) -> None:
        """Drop the forms no route uses (their memory; oneDNN's too: on a 1B model where the 4-bit kernel and
        bf16_gemm take every batch, 1.8 GB of RSS: docs/performance.md, the 1B section)."""
        self.packed = self.packed if "onednn" in paths else None
        self.int4 = self.int4 if paths & {"int4", "int4_f16", "int4_q8"} else None
        if self.int4 is not None:
            self.int4.keep(own="int4" in paths, f16="int4_f16" in paths, q8="int4_q8" in paths)
        self.bf16 = self.bf16 if "bf16_gemm" in paths else None
        self.plain = self.plain if "bf16_plain" in paths else None
        if self.int8 is not None:
            self.int8.packed = self.int8.packed if "int8" in paths else None
            self.int8.q_t = self.int8.q_t if "int8_mm" in paths else None
            self.int8 = self.int8 if self.int8.forms() else None

    def path_for(self, rows: int) -> str:
        return next(path for limit, path in self.route if rows <= limit)

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias) by the route's path for x's rows, or the path given. `out` ([rows, out_features],
        x's dtype): where the int8 paths write it (the others return a new tensor): use the returned one."""
        path = path or self.path_for(x.shape[0])
        if path in ("int8", "int8_mm"):
            return self.int8.mm(x, bias, kernel=path == "int8", out=out)
        if path == "onednn":
            return self.onednn_mm(x, bias)
        if path == "bf16_plain":
            return F.linear(x, self.plain, bias)
        out = self.int4.mm(x) if path == "int4" else self.int4.mm_f16(x) if path == "int4_f16" else \
            self.int4.mm_q8(x) if path == "int4_q8" else self.bf16.mm(x)
        return out if bias is None else out.add_(bias)

    def onednn_mm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Widened: bf16 products are exact in fp32 and a native bf16 matmul sums in fp32 too, so fp32 over the
        widened operands rounded to bf16 once is bf16's matmul, 6-7x faster than torch's emulated one on AVX2."""
        if self.widened:
            out = self._onednn_mm(x.float(), None if bias is None else bias.float())
            return out.to(torch.bfloat16)
        return self._onednn_mm(x, bias)

    def _onednn_mm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        padded = padded_rows(rows) if self.pad_rows else rows
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        xp = x.new_zeros(padded, x.shape[1])
        xp[:rows] = x
        return torch.ops.mkldnn._linear_pointwise(xp, self.packed, bias, "none", [], "")[:rows]


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), on the packed weight when there is one."""
    if isinstance(weight, PackedWeight):
        return weight.mm(x, bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32 and scale in the model dtype, as transformers' LlamaRMSNorm does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 ext: ModuleType | None = None) -> torch.Tensor:
    """`residual += x` in place (skipped when x is None), then the norm of the new residual: the residual stream
    and the next layer's norm in one pass with the C++ kernel `ext`, or as the two torch ops without it."""
    if ext is not None:
        return ext.add_rms_norm(x, residual, weight, eps)
    if x is not None:
        residual.add_(x)
    return rms_norm(residual, weight, eps)


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama 3's long-context rescaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
    factor = rope_scaling["factor"]
    low, high = rope_scaling.get("low_freq_factor", 1.0), rope_scaling.get("high_freq_factor", 4.0)
    old_len = rope_scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables computed once for every position up to the context length."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None,
                 dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 ext: ModuleType | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions (rotate-half convention); in place with the
        C++ kernel `ext`, into new tensors without it."""
        if ext is not None:
            ext.rotary_(q, self.cos, self.sin, positions)
            ext.rotary_(k, self.cos, self.sin, positions)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def swiglu(gate_up: torch.Tensor, ext: ModuleType | None = None) -> torch.Tensor:
    """SiLU(gate) * up on the fused gate/up projection (one pass with the C++ kernel `ext`)."""
    if ext is not None:
        return ext.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
