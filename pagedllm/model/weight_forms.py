"""The forms a linear weight can run as besides oneDNN's packed matmul: the checkpoint's 4-bit weights (Int4Weight),
int8 (Int8Weight) and bf16_gemm's panels (Bf16Weight); layers.PackedWeight holds them and routes each batch."""

from __future__ import annotations

import math
from types import ModuleType

import torch

from pagedllm.model import kernels

# Output columns per torch._int_mm call (Int8Weight without its kernel): 4 MB of int32 products at 256 rows, which the
# caches hold.
INT8_COLUMN_BLOCK = 4096


class Int4Weight:
    """A GGUF Q4_0 / Q4_1 weight packed once for a C++ int4 kernel, which computes with the file's weights exactly:
    w = q * scale + min per group of 32 inputs, scale and min kept as the fp16 values they were. bf16 models run
    csrc/int4_linear.cpp (AVX512-BF16), fp32 ones csrc/int4_linear_f32.cpp (AVX-512F or AVX2), whose weights are bit
    for bit the loader's fp32 ones; each has its own layout. A weight with `f16` also runs csrc/int4_linear_f16.cpp
    (AVX512-FP16: fp16 products at twice fp32's FMA rate, each lane's fp16 sum 32 inputs long), one with `q8`
    csrc/int4_linear_q8.cpp (int8 activations per 32 inputs, each row's 4 largest kept exact: AVX512-VNNI's
    vpdpbusd or AVX2's vpmaddubsw, 4x the products of an fp32 FMA per instruction, the same sums); neither is exact,
    so only where `--dtype auto` chose fp32 (or the model is bf16: fp16 products only), and where dispatch measures
    them faster. Both read the fp32 kernel's layout (`f32_layout`): an fp32 model's own nibbles, a second packing in a
    bf16 model (until a route leaves one unused: `keep`)."""

    GROUP = 32
    TILE = 16  # output rows per tile (bf16 kernel)
    F32_TILE = 64  # ... and the fp32 one's
    BYTES_PER_WEIGHT = 0.5 + 2 * 2 / GROUP  # a nibble, plus an fp16 scale and min per group

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, ext: ModuleType,
                 dtype: torch.dtype = torch.bfloat16, f16: bool = False, own: bool = True, q8: bool = False
                 ) -> None:
        """own: this dtype's kernel's form (a later start whose cached route takes only the fp16 one makes none);
        f16, q8: the fp16 products', the int8 activations' form, where that kernel runs these weights here."""
        self.dtype = dtype
        self.ext = ext
        # the fp16 kernel's weight scale, if it runs here: the power of two that puts every |q * d + m| below 1
        f16 = f16 and self.f16_available(dtype, ext, q.shape[0])
        self.f16_scale = self.weight_scale(scale, min_) if f16 else None
        self.q8 = q8 and self.q8_available(dtype, ext, q.shape[0])
        layout = f16 or self.q8
        # (nibbles, scales, mins) as this dtype's kernel takes them, and as the fp16 and q8 ones do (an fp32 model's
        # own); None where no route takes that kernel
        form = self.packed_form(q, scale, min_, dtype) if own or (layout and dtype == torch.float32) else None
        self.form: tuple[torch.Tensor, ...] | None = form if own else None
        self.f32_layout = (form if dtype == torch.float32 else self.packed_form(q, scale, min_, torch.float32)) \
            if layout else None

    @classmethod
    def packed_form(cls, q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, ...]:
        """The nibbles, scales and mins in the layout of this dtype's kernel."""
        packed = cls.pack_f32(q) if dtype == torch.float32 else cls.pack_bf16(q)
        tiles, tile, groups = packed.shape[0], cls.tile(dtype), q.shape[1] // cls.GROUP
        return packed, *(a.view(tiles, tile, groups).transpose(1, 2).contiguous().half() for a in (scale, min_))

    @classmethod
    def f16_available(cls, dtype: torch.dtype, ext: ModuleType | None, rows: int = F32_TILE) -> bool:
        """int4_linear_f16 runs this model dtype's 4-bit weights of `rows` outputs here (a build with AVX512-FP16;
        whole tiles of the fp32 kernel's layout)."""
        return (dtype in (torch.float32, torch.bfloat16) and rows % cls.F32_TILE == 0 and ext is not None
                and ext.int4_linear_f16_supported())

    @classmethod
    def q8_available(cls, dtype: torch.dtype, ext: ModuleType | None, rows: int = F32_TILE) -> bool:
        """int4_linear_q8 runs this model dtype's 4-bit weights of `rows` outputs here (an fp32 model: in bf16 its
        error sits at the accuracy gate's edge, model_runner.int8_activations; a build with AVX512-VNNI and
        AVX512-VBMI, or AVX2; whole tiles of the fp32 kernel's layout)."""
        return (dtype == torch.float32 and rows % cls.F32_TILE == 0 and ext is not None
                and ext.int4_linear_q8_supported())

    def keep(self, own: bool, f16: bool, q8: bool = False) -> None:
        """Drop the kernels' forms no route takes (own: this dtype's kernel; f16: the fp16 products'; q8: the int8
        activations')."""
        self.form = self.form if own else None
        self.f16_scale = self.f16_scale if f16 else None
        self.q8 = self.q8 and q8
        self.f32_layout = self.f32_layout if self.f16_scale is not None or self.q8 else None

    @staticmethod
    def weight_scale(scale: torch.Tensor, min_: torch.Tensor) -> float:
        """2^-e where 2^e bounds the weights' magnitudes (|q * d + m| <= 15 |d| + |m|): exact to divide out."""
        largest = (15 * scale.float().abs() + min_.float().abs()).max().item()
        return 2.0 ** -math.frexp(largest)[1] if 0 < largest < math.inf else 1.0

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
        """A kernel runs this dtype's activations here (bf16: AVX512-BF16; fp32: AVX-512F or AVX2), on whole tiles of
        output rows and groups of 32 inputs, and scale and min are fp16 values (exactly GGUF's own)."""
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
        return kernel(x.contiguous(), *self.form)

    def mm_f16(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with fp16 products (int4_linear_f16.cpp), in x's dtype; only where f16_scale is set."""
        return self.ext.int4_linear_f16(x.contiguous(), *self.f32_layout, self.f16_scale)

    def mm_q8(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T against int8 activations (int4_linear_q8.cpp), in x's dtype; only where q8 is set."""
        return self.ext.int4_linear_q8(x.contiguous(), *self.f32_layout)


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
        kernel = self.packed is not None if kernel is None else kernel
        qmax = self.ext.int8_gemm_input_max() if kernel else 127
        x = x.contiguous()
        if self.outliers and x.shape[0] > 0:  # their product is added as the int8 one is written (one rounding)
            # one C++ pass picks them (amax(0).topk), quantises the rest and keeps theirs; the kernels read their
            # rows of plain_t in place (with four torch ops and a gather, 1.5 MB of the lm_head's, a 1-row call took
            # 1.67 ms instead of 1.41, Zen 4: docs/performance.md)
            q, scale, channels, big = self.ext.split_outliers_int8(x, self.outliers, qmax)
            return self._int8_mm(q, scale, x, bias, kernel, out, (big, self.plain_t, channels))
        q, scale = self.ext.quantize_rows_int8(x, qmax)
        return self._int8_mm(q, scale, x, bias, kernel, out, ())

    def _int8_mm(self, q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                 kernel: bool, out: torch.Tensor | None, extra: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The product of the quantised rows q (scale) into `out` (new, x's dtype, if None); `extra`: the outlier
        channels' (extra_x, plain_t, channels) or ()."""
        out = x.new_empty(x.shape[0], self.out_features) if out is None else out
        if kernel:
            self.ext.int8_gemm(q, self.packed, scale, self.scale, bias, out, *extra)
            return out
        for cols in self.blocks:
            acc = torch._int_mm(q, self.q_t[:, cols])
            blocked = (extra[0], extra[1][:, cols], extra[2]) if extra else ()
            self.ext.dequantize_int32(acc, scale, self.scale[cols], None if bias is None else bias[cols], out[:, cols],
                                      *blocked)
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
