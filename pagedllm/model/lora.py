"""Batched multi-LoRA: the resident adapters' weights stacked by slot, and a step's tokens grouped by slot, so each
fused projection adds every adapter's delta with two batched matmuls (Punica's SGMV idea, in torch ops): tokens of
one slot form a segment, padded to the longest, and `bmm` runs all segments at once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.model.loader import ModelConfig
from pagedllm.model.loader.peft import LoRAAdapter, projection_shape

# The model's fused matmuls and the projections each one stacks (in output order).
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


@dataclass
class LoRABatch:
    """A step's tokens by adapter slot, built once per step: segment s holds slot `first + s`'s tokens."""

    first: int  # the lowest slot in the step
    rows: torch.Tensor  # int64 [S * L]: the token of each segment position (pads point at token 0)
    mask: torch.Tensor  # [S, L, 1]: 1 for a real token, 0 for a pad
    num_slots: int  # S: the slots from first to the highest one in the step
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
        tokens, slots = tokens[order], slots[order]
        first = int(slots[0])
        slots -= first
        counts = torch.bincount(slots)
        length = int(counts.max())
        position = torch.arange(len(tokens)) - (torch.cumsum(counts, 0) - counts)[slots]
        rows = torch.zeros(len(counts), length, dtype=torch.int64)
        rows[slots, position] = tokens
        mask = torch.zeros(len(counts), length, 1, dtype=dtype)
        mask[slots, position] = 1
        return cls(first, rows.view(-1), mask, len(counts), kinds)


class LoRAStack:
    """Slots of resident adapters per layer and fused matmul: A [slots, in, n * rank] and B [slots, n * rank, out],
    the n projections of a fused matmul side by side in A and block-diagonal in B, ranks padded with zeros to
    max_lora_rank (zeros add nothing), scales folded into B."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        self.max_rank = max_rank
        self.dtype = dtype
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(config.num_hidden_layers):
            a, b = {}, {}
            for kind, projections in FUSED.items():
                in_features = projection_shape(config, projections[0])[1]
                out_features = sum(projection_shape(config, p)[0] for p in projections)
                width = len(projections) * max_rank
                a[kind] = torch.zeros(max_loras, in_features, width, dtype=dtype)
                b[kind] = torch.zeros(max_loras, width, out_features, dtype=dtype)
            self.a.append(a)
            self.b.append(b)
        self.offsets = {kind: self._offsets(config, projections) for kind, projections in FUSED.items()}
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
        for layer_a, layer_b in zip(self.a, self.b):
            for kind in FUSED:
                layer_a[kind][slot].zero_()
                layer_b[kind][slot].zero_()
        for (layer, projection), (a, b) in adapter.weights.items():
            kind = next(k for k, ps in FUSED.items() if projection in ps)
            j, rank = FUSED[kind].index(projection) * self.max_rank, a.shape[0]
            start, width = self.offsets[kind][projection]
            self.a[layer][kind][slot, :, j:j + rank] = a.T
            self.b[layer][kind][slot, j:j + rank, start:start + width] = b.T
        self.kinds[slot] = frozenset(k for k, ps in FUSED.items() if any(p in ps for _, p in adapter.weights))

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, layer: int, kind: str, batch: LoRABatch) -> torch.Tensor:
        """out[t] += B_slot(t) (A_slot(t) x[t]) for every token with an adapter, in place; returns out."""
        slots = slice(batch.first, batch.first + batch.num_slots)
        a, b = self.a[layer][kind][slots], self.b[layer][kind][slots]
        xs = x.index_select(0, batch.rows).view(batch.num_slots, -1, x.shape[1])
        shrunk = torch.bmm(xs, a).mul_(batch.mask)  # pads' rows zeroed: they add nothing to token 0
        delta = torch.bmm(shrunk, b)
        return out.index_add_(0, batch.rows, delta.view(-1, out.shape[1]))


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
