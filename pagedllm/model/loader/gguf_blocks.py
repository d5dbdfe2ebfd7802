"""ggml's plain block formats (Q4_0, Q4_1, Q8_0: one fp16 scale, for Q4_1 an fp16 min, per 32 weights) read with
torch. The values are bit for bit what gguf-py's numpy reference gives (the same float32 products and sums, in the
same order), in under half its time and on every thread: gguf-py's took the larger part of the default model's build.
The K-quants and the rest stay with gguf-py."""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32  # weights per block in all three formats
FAST_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_LAYOUTS = {  # the bytes of one block, in order
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", BLOCK // 2)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", BLOCK // 2)]),
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", BLOCK)]),
}


def _fields(data: np.ndarray, kind: str) -> np.ndarray:
    """A [rows, bytes per row] uint8 array of `kind` blocks as a [rows, blocks] structured view (no copy)."""
    return np.ascontiguousarray(data).view(_LAYOUTS[kind])


def _scales(blocks: np.ndarray, name: str) -> torch.Tensor:
    """An fp16 field of every block as float32 [rows, blocks]."""
    return torch.from_numpy(np.ascontiguousarray(blocks[name])).float()


def q4_parts(data: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q4_0 / Q4_1 rows as stored: the 4-bit values (uint8 [rows, cols]; a block's low nibbles hold its first 16
    weights, the high nibbles its last 16), the scales and, for Q4_1, the mins (float32 [rows, cols / 32])."""
    blocks = _fields(data, kind)
    nibbles = torch.from_numpy(np.ascontiguousarray(blocks["qs"]))  # [rows, blocks, 16]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(nibbles.shape[0], -1)
    return q, _scales(blocks, "d"), _scales(blocks, "m") if kind == "Q4_1" else None


def q4_values(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """float32 weights from q4_parts: d * q + m (Q4_1), d * (q - 8) (Q4_0), each product and sum rounded as
    gguf-py's are (no fused multiply-add)."""
    rows, cols = q.shape
    q = q.reshape(rows, -1, BLOCK)
    if m is None:
        return (d[..., None] * (q.to(torch.int8) - 8).float()).reshape(rows, cols)
    return (d[..., None] * q.float()).add_(m[..., None]).reshape(rows, cols)


def dequantize_blocks(data: np.ndarray, kind: str) -> torch.Tensor:
    """float32 [rows, cols] of a [rows, bytes per row] tensor in one of FAST_TYPES."""
    if kind != "Q8_0":
        return q4_values(*q4_parts(data, kind))
    blocks = _fields(data, kind)
    x = torch.from_numpy(np.ascontiguousarray(blocks["qs"])).float()  # [rows, blocks, 32]
    return (x * _scales(blocks, "d")[..., None]).reshape(x.shape[0], -1)
