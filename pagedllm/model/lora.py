"""Batched multi-LoRA: the resident adapters' weights stacked by slot, and a step's tokens grouped by slot (Punica's
SGMV): tokens of one slot form a segment, and each fused projection adds every adapter's delta in one C++ kernel
(csrc/lora_sgmv.cpp) that reads each segment's adapter once, with no padding. Without the extension, or for a dtype
it does not handle (other than float32 and bfloat16), two batched torch matmuls over the segments padded to the
longest one compute the same."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType

import torch

from pagedllm.model.loader import ModelConfig
from pagedllm.model.loader.peft import LoRAAdapter, projection_shape

# The model's fused matmuls and the projections each one stacks (in output order).
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
SGMV_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel computes in; others take the torch path


@dataclass
class LoRABatch:
    """A step's tokens by adapter slot, built once per step: the tokens with an adapter sorted by slot, segment s
    holding positions starts[s]:starts[s + 1] of slot slots[s] (no empty segment)."""

    tokens: torch.Tensor  # int64 [N]: the token (row of the step) at each sorted position
    starts: torch.Tensor  # int64 [S + 1]
    slots: torch.Tensor  # int64 [S]
    dtype: torch.dtype
    kinds: frozenset[str] = frozenset(FUSED)  # the fused matmuls some adapter of the step targets (others: no op)

    @classmethod
    def build(cls, token_slots: torch.Tensor, dtype: torch.dtype,
              kinds: frozenset[str] = frozenset(FUSED)) -> LoRABatch | None:
        """From each token's slot (-1: no adapter); None when no token has one (the base path runs alone)."""
        tokens = (token_slots >= 0).nonzero().squeeze(1)
        if len(tokens) == 0:
            return None
        slots = token_slots[tokens]
        order = torch.argsort(slots, stable=True)
        slots, counts = torch.unique_consecutive(slots[order], return_counts=True)
        starts = torch.zeros(len(counts) + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=starts[1:])
        return cls(tokens[order], starts, slots.to(torch.int64), dtype, kinds)

    @cached_property
    def padded(self) -> tuple[slice, torch.Tensor, torch.Tensor]:
        """For the torch path, one padded segment per slot from the lowest of the step to the highest (slots of no
        token included, empty: the stack's slots are then a view): those slots, rows [S * L] (each segment's tokens
        padded to the longest; pads point at token 0) and mask [S, L, 1] (1 for a real token, 0 for a pad)."""
        first, counts = int(self.slots[0]), self.starts[1:] - self.starts[:-1]
        segment = torch.repeat_interleave(self.slots - first, counts)
        position = torch.arange(len(self.tokens)) - torch.repeat_interleave(self.starts[:-1], counts)
        rows = torch.zeros(int(self.slots[-1]) - first + 1, int(counts.max()), dtype=torch.int64)
        rows[segment, position] = self.tokens
        mask = torch.zeros(*rows.shape, 1, dtype=self.dtype)
        mask[segment, position] = 1
        return slice(first, first + len(rows)), rows.view(-1), mask


class LoRAStack:
    """Slots of resident adapters per layer and fused matmul: A [slots, in, W] and B [slots, W, out], the n
    projections of a fused matmul side by side in A and block-diagonal in B, ranks padded with zeros to max_lora_rank
    and W = n * max_lora_rank to a multiple of 16 (the kernel's vectors; zeros add nothing), scales folded into B.
    `ext`: the C++ kernels (None: the torch path)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 ext: ModuleType | None = None) -> None:
        self.max_rank = max_rank
        self.dtype = dtype
        self.ext = ext if dtype in SGMV_DTYPES else None
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        self.ranks: list[dict[str, torch.Tensor]] = []  # int64 [slots, n]: each projection's rank (0: not targeted)
        for _ in range(config.num_hidden_layers):
            a, b = {}, {}
            for kind, projections in FUSED.items():
                in_features = projection_shape(config, projections[0])[1]
                out_features = sum(projection_shape(config, p)[0] for p in projections)
                width = -(-len(projections) * max_rank // 16) * 16
                a[kind] = torch.zeros(max_loras, in_features, width, dtype=dtype)
                b[kind] = torch.zeros(max_loras, width, out_features, dtype=dtype)
            self.a.append(a)
            self.b.append(b)
            self.ranks.append({kind: torch.zeros(max_loras, len(ps), dtype=torch.int64) for kind, ps in FUSED.items()})
        self.offsets = {kind: self._offsets(config, projections) for kind, projections in FUSED.items()}
        self.widths = {kind: [width for _, width in self.offsets[kind].values()] for kind in FUSED}
        self.kinds: list[frozenset[str]] = [frozenset()] * max_loras  # the fused matmuls each slot's adapter targets

    @staticmethod
    def _offsets(config: ModelConfig, projections: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """Each projection's first output column and width in its fused matmul."""
        offsets, start = {}, 0
        for p in projections:
            width = projection_shape(config, p)[0]
            offsets[p] = (start, width)
            start += width
        return offsets

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into a slot (every projection it does not target stays zero)."""
        for layer_a, layer_b, layer_ranks in zip(self.a, self.b, self.ranks):
            for kind in FUSED:
                layer_a[kind][slot].zero_()
                layer_b[kind][slot].zero_()
                layer_ranks[kind][slot] = 0
        for (layer, projection), (a, b) in adapter.weights.items():
            kind = next(k for k, ps in FUSED.items() if projection in ps)
            index, rank = FUSED[kind].index(projection), a.shape[0]
            j = index * self.max_rank
            start, width = self.offsets[kind][projection]
            self.a[layer][kind][slot, :, j:j + rank] = a.T
            self.b[layer][kind][slot, j:j + rank, start:start + width] = b.T
            self.ranks[layer][kind][slot, index] = rank
        self.kinds[slot] = frozenset(k for k, ps in FUSED.items() if any(p in ps for _, p in adapter.weights))

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, layer: int, kind: str, batch: LoRABatch) -> torch.Tensor:
        """out[t] += B_slot(t) (A_slot(t) x[t]) for every token with an adapter, in place; returns out."""
        a, b = self.a[layer][kind], self.b[layer][kind]
        if self.ext is not None and x.dtype == out.dtype == self.dtype and x.stride(1) == out.stride(1) == 1:
            self.ext.lora_sgmv(out, x, a, b, batch.tokens, batch.starts, batch.slots, self.ranks[layer][kind],
                               self.max_rank, self.widths[kind])
            return out
        return self.add_delta_padded(out, x, a, b, batch)

    @staticmethod
    def add_delta_padded(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         batch: LoRABatch) -> torch.Tensor:
        """The torch path (and the kernel's reference): gather each segment's tokens padded to the longest, `bmm` by
        A, zero the pads, `bmm` by B, add back."""
        slots, rows, mask = batch.padded
        xs = x.index_select(0, rows).view(mask.shape[0], -1, x.shape[1])
        shrunk = torch.bmm(xs, a[slots]).mul_(mask)  # pads' rows zeroed: they add nothing to token 0
        delta = torch.bmm(shrunk, b[slots])
        return out.index_add_(0, rows, delta.view(-1, out.shape[1]))


class AdapterStore:
    """Every registered adapter's folder and, for the `capacity` most recently used (None: all), its weights: the CPU
    copy a slot is loaded from; an adapter whose copy was dropped is read from its folder again when next loaded."""

    def __init__(self, read: Callable[[str], LoRAAdapter], capacity: int | None = None) -> None:
        self.read = read
        self.capacity = capacity
        self.paths: dict[int, str] = {}
        self.copies: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_reads = 0  # adapters read again from their folder

    def add(self, lora_int_id: int, adapter: LoRAAdapter, path: str) -> None:
        self.paths[lora_int_id] = path
        self._keep(lora_int_id, adapter)

    def remove(self, lora_int_id: int) -> None:
        self.paths.pop(lora_int_id, None)
        self.copies.pop(lora_int_id, None)

    def get(self, lora_int_id: int) -> LoRAAdapter:
        adapter = self.copies.get(lora_int_id)
        if adapter is None:
            adapter = self.read(self.paths[lora_int_id])
            self.num_reads += 1
        self._keep(lora_int_id, adapter)
        return adapter

    def _keep(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        self.copies[lora_int_id] = adapter
        self.copies.move_to_end(lora_int_id)
        while self.capacity is not None and len(self.copies) > self.capacity:
            self.copies.popitem(last=False)
