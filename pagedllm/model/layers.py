"""The small layers of a Llama-family model: linear weights (packed bf16, 4-bit), RMSNorm, rotary embeddings, SwiGLU.
Numerics follow transformers'."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedllm.model import kernels

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
# Output columns per torch._int_mm call (Int8Weight without its kernel): 4 MB of int32 products at 256 rows, which the
# caches hold.
INT8_COLUMN_BLOCK = 4096


class Int4Weight:
    """A GGUF Q4_0 / Q4_1 weight packed once for a C++ int4 kernel, which computes with the file's weights exactly:
    w = q * scale + min per group of 32 inputs, scale and min kept as the fp16 values they were. bf16 models run
    csrc/int4_linear.cpp (AVX512-BF16), fp32 ones csrc/int4_linear_f32.cpp (AVX-512F), whose weights are bit for bit
    the loader's fp32 ones; each has its own layout."""

    GROUP = 32
    TILE = 16  # output rows per tile (bf16 kernel)
    F32_TILE = 64  # ... and the fp32 one's
    BYTES_PER_WEIGHT = 0.5 + 2 * 2 / GROUP  # a nibble, plus an fp16 scale and min per group

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, ext: ModuleType,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype
        self.packed = self.pack_f32(q) if dtype == torch.float32 else self.pack_bf16(q)
        tiles, tile, groups = self.packed.shape[0], self.tile(dtype), q.shape[1] // self.GROUP
        self.scales, self.mins = (a.view(tiles, tile, groups).transpose(1, 2).contiguous().half()
                                  for a in (scale, min_))
        self.ext = ext

    @classmethod
    def tile(cls, dtype: torch.dtype) -> int:
        return cls.F32_TILE if dtype == torch.float32 else cls.TILE

    @classmethod
    def pack_bf16(cls, q: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N/16, K/32, 8, 32] (int4_linear.cpp's layout)."""
        rows, cols = q.shape
        tiles, groups = rows // cls.TILE, cols // cls.GROUP
        # [tile, row i, group, k-pair p, j] -> [tile, group, p, i, j]; k-pairs 2pp and 2pp + 1 share bytes (low, high)
        pairs = q.view(tiles, cls.TILE, groups, 16, 2).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 8, 2, 32)
        return (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).contiguous()

    @classmethod
    def pack_f32(cls, q: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N/64, K/32, 2, 32, 16] (int4_linear_f32.cpp's layout): byte b of [t, g, h, k] holds columns
        64t + 32h + b (low nibble) and + 16 (high) at input 32g + k."""
        rows, cols = q.shape
        tiles, groups = rows // cls.F32_TILE, cols // cls.GROUP
        # [tile, half h, nibble n, b, group, k] -> [tile, group, h, k, b, n]
        split = q.view(tiles, 2, 2, 16, groups, cls.GROUP).permute(0, 4, 1, 5, 3, 2)
        return (split[..., 0] | (split[..., 1] << 4)).contiguous()

    @classmethod
    def available(cls, q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, dtype: torch.dtype,
                  ext: ModuleType | None) -> bool:
        """A kernel runs this dtype's activations here (bf16: AVX512-BF16; fp32: AVX-512F), on whole tiles of output
        rows and groups of 32 inputs, and scale and min are fp16 values (exactly GGUF's own)."""
        rows, cols = q.shape
        return (cls.kernel_available(dtype, ext) and rows % cls.tile(dtype) == 0 and cols % cls.GROUP == 0
                and all(torch.equal(a.half().float(), a) for a in (scale, min_)))

    @staticmethod
    def kernel_available(dtype: torch.dtype, ext: ModuleType | None) -> bool:
        """This build has a kernel for this dtype's activations."""
        kernel = {torch.bfloat16: "int4_linear_supported", torch.float32: "int4_linear_f32_supported"}.get(dtype)
        return ext is not None and kernel is not None and getattr(ext, kernel)()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.ext.int4_linear_f32 if self.dtype == torch.float32 else self.ext.int4_linear
        return kernel(x.contiguous(), self.packed, self.scales, self.mins)


def transposed(plain: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """plain.t().contiguous(), copied `rows` rows at a time: in one call torch's copy strides across the whole output
    (a 49,152 x 576 lm_head: 0.09-0.17 s against 0.04-0.05 in blocks of 256 rows, AMD EPYC Zen 3:
    docs/results/side_by_side/2026-11-30/startup_build/probes/transpose_blocks.py)."""
    out = plain.new_empty(plain.shape[1], plain.shape[0])
    for i in range(0, plain.shape[0], rows):
        out[:, i:i + rows] = plain[i:i + rows].t()
    return out


class Int8Weight:
    """A weight in int8, one scale per output row (w8a8): activations are quantised per row (token) on the fly, the
    product sums exactly in int32 and is scaled back into the output as it is written. Numerics change beyond bf16
    rounding: opt-in, or by default where the accuracy gate passes (docs/performance.md).

    The product is the C++ kernel int8_gemm (csrc/int8_gemm.cpp: AVX512-VNNI, or AVX2's vpmaddubsw, exact for
    activations within +-64, so they are quantised to that there; the weight packed once here); on Zen 5 the lm_head's
    576 -> 49,152 runs there in ~0.7 ms at 1-4 rows (the weight's read) and at ~790 GOP/s from 16 rows up, where
    torch._int_mm, which gets a plain weight and reorders it on every call, took 1.6-2.2 ms and 300-640 GOP/s (`python
    docs/scripts/lm_head_int8.py`). Without the kernel (inputs not a multiple of 4; only where oneDNN's int8 is exact,
    with VNNI or AMX) the product is torch._int_mm over INT8_COLUMN_BLOCK output columns at a time (in one call over
    49,152 columns oneDNN fell from ~680 to ~400 GOP/s past 160 rows, its int32 output outgrew the caches; `python
    docs/scripts/int8_column_blocks.py`), scaled back by dequantize_int32 (csrc/int8_linear.cpp)."""

    PANEL = 64  # output columns per panel of the packed weight (4 tiles of 16)

    def __init__(self, plain: torch.Tensor, ext: ModuleType, kernel: bool = True, outliers: int = 0,
                 int_mm: bool = False) -> None:
        """kernel=False: the torch._int_mm path even where the kernel runs (to compare the two); int_mm=True: both
        where oneDNN's products are exact (model/dispatch.py times them: oneDNN's int8 matmul runs on AMX tiles where
        the CPU has them; without VNNI it saturates, so only the kernel runs). outliers: input
        channels per call kept out of the int8 product (see mm); keeps a transposed copy of the weight for them."""
        self.outliers = min(outliers, plain.shape[1])
        self.plain_t = transposed(plain) if self.outliers else None  # [in, out]: a channel's weights in a row
        q, self.scale = ext.quantize_rows_int8(plain.contiguous())  # as the activations: round(w * (1 / scale))
        self.out_features = q.shape[0]
        self.ext = ext
        self.packed: torch.Tensor | None = None  # for int8_gemm
        self.q_t: torch.Tensor | None = None  # [in, out] view, for torch._int_mm
        if kernel and self.kernel_available(ext, q.shape[1]):
            self.packed = self.pack(q)
        exact = kernels.int8_products_exact()  # oneDNN's: without VNNI its sums saturate
        if self.packed is None and not exact:
            raise ValueError("no exact int8 product for this weight here: oneDNN's int8 sums saturate without "
                             f"VNNI, and int8_gemm (kernel={kernel}) takes inputs in groups of 4 ({q.shape[1]})")
        if self.packed is None or (int_mm and exact):
            self.q_t = q.t()
        self.blocks = [slice(j, j + INT8_COLUMN_BLOCK) for j in range(0, q.shape[0], INT8_COLUMN_BLOCK)]

    @classmethod
    def forms_for(cls, ext: ModuleType | None, in_features: int, int_mm: bool = False) -> frozenset[str]:
        """The products a weight of `in_features` inputs gets here (forms(), before it is made)."""
        kernel = cls.kernel_available(ext, in_features)
        int_mm = not kernel or (int_mm and kernels.int8_products_exact())
        return frozenset(name for name, made in (("int8", kernel), ("int8_mm", int_mm)) if made)

    @staticmethod
    def kernel_available(ext: ModuleType | None, in_features: int) -> bool:
        """int8_gemm runs on AVX512-VNNI or AVX2, over inputs in groups of 4 (at most 66,308 of them: int32 sums)."""
        return ext is not None and ext.int8_gemm_supported() and in_features % 4 == 0 and 0 < in_features <= 66308

    @classmethod
    def pack(cls, q: torch.Tensor) -> torch.Tensor:
        """int8 [N, K] -> the kernel's layout, uint8 [ceil(N / 64), K / 4, 4, 64]: byte 4j + b of [p, g, c] is
        q[64p + 16c + j, 4g + b] + 128 (vpdpbusd's unsigned operand), rows past N zero (128)."""
        n, k = q.shape
        panels = -(-n // cls.PANEL)
        u8 = torch.full((panels * cls.PANEL, k), 128, dtype=torch.uint8)
        u8[:n] = q.view(torch.uint8) ^ 0x80  # two's complement: q + 128 is q's bits with the top one flipped
        return u8.view(panels, 4, 16, k // 4, 4).permute(0, 3, 1, 2, 4).reshape(panels, k // 4, 4, 64)

    def int8_rows(self) -> torch.Tensor:
        """The int8 weight [out, in] this computes with."""
        if self.packed is None:
            return self.q_t.t()
        panels, groups = self.packed.shape[:2]
        u8 = self.packed.view(panels, groups, 4, 16, 4).permute(0, 2, 3, 1, 4).reshape(panels * self.PANEL, -1)
        return (u8[:self.out_features] ^ 0x80).view(torch.int8)

    def forms(self) -> frozenset[str]:
        """dispatch's path names of the products this weight has: the kernel's and torch._int_mm's."""
        return frozenset(name for name, form in (("int8", self.packed), ("int8_mm", self.q_t)) if form is not None)

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None, kernel: bool | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias), into `out` when given, by the kernel where there is one (or as `kernel` says). With
        outliers, the input channels largest in this call go through the plain weight and the rest through int8, as
        LLM.int8() splits them: a few channels of the model's hidden state run 10-25x the median, and one int8 scale
        per row that holds them leaves the others a few steps each."""
        big = w = None
        if self.outliers and x.shape[0] > 0:  # their product is added as the int8 one is written (one rounding)
            channels = x.abs().amax(dim=0).topk(self.outliers).indices
            big, x = x.index_select(1, channels).float(), x.index_fill(1, channels, 0)
            w = self.plain_t.index_select(0, channels)
        return self._int8_mm(x, bias, self.packed is not None if kernel is None else kernel, big, w, out)

    def _int8_mm(self, x: torch.Tensor, bias: torch.Tensor | None, kernel: bool, big: torch.Tensor | None,
                 w: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        q, scale = self.ext.quantize_rows_int8(x.contiguous(), self.ext.int8_gemm_input_max() if kernel else 127)
        out = x.new_empty(x.shape[0], self.out_features) if out is None else out
        if kernel:
            self.ext.int8_gemm(q, self.packed, scale, self.scale, bias, out, big, w)
            return out
        for cols in self.blocks:
            acc = torch._int_mm(q, self.q_t[:, cols])
            self.ext.dequantize_int32(acc, scale, self.scale[cols], None if bias is None else bias[cols], out[:, cols],
                                      big, None if w is None else w[:, cols])
        return out


class Bf16Weight:
    """A bf16 weight [out, in] packed once for the C++ bf16_gemm (csrc/bf16_gemm.cpp): panels of 64 output columns,
    each one contiguous stream of k-pairs in vdpbf16ps's lane order. A decode step reads each layer's weights from
    memory once, and oneDNN's packed matmul lost ~12% of its time to those first reads at 64 rows
    (docs/scripts/linear_cold_weights.py)."""

    PANEL = 64

    def __init__(self, plain: torch.Tensor, ext: ModuleType) -> None:
        self.packed = self.pack(plain)
        self.ext = ext

    @classmethod
    def available(cls, plain: torch.Tensor, ext: ModuleType | None) -> bool:
        """The kernel runs bf16 on AVX512-BF16, over whole panels of output columns and pairs of inputs."""
        rows, cols = plain.shape
        return (ext is not None and ext.bf16_gemm_supported() and plain.dtype == torch.bfloat16
                and rows % cls.PANEL == 0 and cols % 2 == 0)

    @classmethod
    def pack(cls, w: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N / 64, K / 2, 4, 32]: element 2i + j of [p, kp, c] is w[64p + 16c + i, 2kp + j]."""
        n, k = w.shape
        return w.view(n // cls.PANEL, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4).reshape(n // cls.PANEL, k // 2, 4, 32)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ext.bf16_gemm(x.contiguous(), self.packed)


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
        forms = {"int4": self.int4, "bf16_gemm": self.bf16, "bf16_plain": self.plain}
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
        self.int4 = self.int4 if "int4" in paths else None
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
        out = self.int4.mm(x) if path == "int4" else self.bf16.mm(x)
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
