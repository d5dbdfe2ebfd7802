"""Batched multi-LoRA: the resident adapters' weights in the KV cache blocks they hold (S-LoRA's unified paging),
found by slot through page tables, and a step's tokens grouped by slot (Punica's SGMV): tokens of one slot form a
segment, and each fused projection adds every adapter's delta in one C++ kernel (csrc/lora_sgmv.cpp) that reads each
segment's adapter once from its pages, with no padding. Without the extension, or for a dtype it does not handle
(other than float32 and bfloat16), two batched torch matmuls over the segments padded to the longest one compute the
same from a dense copy of the pages."""

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
TILE = 64  # output columns per row of B in the pages (the kernel's expand tile)


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
    """The resident adapters by slot, their weights in the KV cache's blocks (S-LoRA's unified paging): a slot's
    weights are rows packed into pages, a page being one layer's K or V part of a block its adapter holds (so a row is
    at most a few hundred bytes, whatever the KV dtype or block size), and a page table per slot, layer and fused
    matmul gives the pages' addresses to the kernel. Per layer and fused matmul, A is `in` rows of the n projections'
    ranks side by side, rounded up to 16 (the kernel's vectors), and B, per targeted projection, per tile of TILE
    output columns, its rank rows of TILE columns (scales folded in). W: the widest A row (n x max_lora_rank).
    `ext`: the C++ kernels (None: the torch path, which reads a dense copy of the pages)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 ext: ModuleType | None = None) -> None:
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.dtype = dtype
        self.ext = ext if dtype in SGMV_DTYPES else None
        self.num_layers = config.num_hidden_layers
        self.ranks: list[dict[str, torch.Tensor]] = [  # int64 [slots, n]: each projection's rank (0: not targeted)
            {kind: torch.zeros(max_loras, len(ps), dtype=torch.int64) for kind, ps in FUSED.items()}
            for _ in range(self.num_layers)]
        self.offsets = {kind: self._offsets(config, projections) for kind, projections in FUSED.items()}
        self.widths = {kind: [width for _, width in self.offsets[kind].values()] for kind in FUSED}
        self.in_features = {kind: projection_shape(config, ps[0])[1] for kind, ps in FUSED.items()}
        self.row_widths = {kind: -(-len(ps) * max_rank // 16) * 16 for kind, ps in FUSED.items()}  # W
        self.kinds: list[frozenset[str]] = [frozenset()] * max_loras  # the fused matmuls each slot's adapter targets
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.page_bytes = 0
        self.tables: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []  # per layer and kind: A's, B's pages
        self.pieces: list[dict[tuple[int, str, str], list[int]]] = [{} for _ in range(max_loras)]  # slot's pages
        self.blocks: dict[int, list[int]] = {}  # slot -> the blocks its adapter holds

    @staticmethod
    def _offsets(config: ModelConfig, projections: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """Each projection's first output column and width in its fused matmul."""
        offsets, start = {}, 0
        for p in projections:
            width = projection_shape(config, p)[0]
            offsets[p] = (start, width)
            start += width
        return offsets

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The KV cache whose blocks hold the weights ([num_blocks, ...] per layer, K and V), and empty page tables
        (ValueError if a page cannot hold a row)."""
        self.caches = kv_caches
        self.page_bytes = kv_caches[0][0][0].numel() * kv_caches[0][0].element_size()
        if min(self.page_bytes // (self.row_widths[kind] * self.dtype.itemsize) for kind in FUSED) < 1 or \
                self.rows_per_page("b", [0]) < 1:
            longest = max(max(self.row_widths.values()), TILE) * self.dtype.itemsize
            raise ValueError(f"LoRA weights are paged in the KV cache's blocks: a row of {longest} bytes does not fit "
                             f"one layer's {self.page_bytes} bytes of a block; raise --block-size or lower "
                             "--max-lora-rank")
        self.tables = [{kind: self._empty_tables(kind) for kind in FUSED} for _ in range(self.num_layers)]

    def _empty_tables(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A fused matmul's page tables of A and B [slots, pages], wide enough for every projection at max rank."""
        ranks = [self.max_rank] * len(FUSED[kind])
        pages_a = -(-self.in_features[kind] // self.rows_per_page("a", ranks))
        pages_b = -(-self._b_rows(kind, ranks) // self.rows_per_page("b", ranks))
        return (torch.zeros(self.max_loras, pages_a, dtype=torch.int64),
                torch.zeros(self.max_loras, pages_b, dtype=torch.int64))

    @staticmethod
    def a_width(ranks: list[int]) -> int:
        """An A row's length: the projections' ranks side by side, rounded up to 16."""
        return -(-sum(ranks) // 16) * 16

    def rows_per_page(self, part: str, ranks: list[int]) -> int:
        return self.page_bytes // ((self.a_width(ranks) if part == "a" else TILE) * self.dtype.itemsize)

    def _b_rows(self, kind: str, ranks: list[int]) -> int:
        """B's rows: each projection's tiles of TILE columns times its rank."""
        return sum(-(-width // TILE) * rank for width, rank in zip(self.widths[kind], ranks))

    def _shapes(self, adapter: LoRAAdapter) -> dict[tuple[int, str], list[int]]:
        """Each (layer, fused matmul) the adapter targets: its projections' ranks (0: not targeted)."""
        shapes: dict[tuple[int, str], list[int]] = {}
        for (layer, projection), (a, _) in adapter.weights.items():
            kind = next(k for k, ps in FUSED.items() if projection in ps)
            shapes.setdefault((layer, kind), [0] * len(FUSED[kind]))[FUSED[kind].index(projection)] = a.shape[0]
        return dict(sorted(shapes.items()))

    def _pieces(self, adapter: LoRAAdapter) -> list[tuple[int, str, str, int, int]]:
        """(layer, kind, part, rows, rows per page) of every piece of the layout, in the order they fill the pages."""
        return [(layer, kind, part, self.in_features[kind] if part == "a" else self._b_rows(kind, ranks),
                 self.rows_per_page(part, ranks))
                for (layer, kind), ranks in self._shapes(adapter).items() for part in ("a", "b")]

    def blocks_needed(self, adapter: LoRAAdapter) -> int:
        """KV blocks the adapter's layout fills (each piece starts a page; a block has 2 x layers pages)."""
        pages = sum(-(-rows // per_page) for *_, rows, per_page in self._pieces(adapter))
        return -(-pages // (2 * self.num_layers))

    def page(self, blocks: list[int], index: int) -> torch.Tensor:
        """Page `index` of an adapter holding `blocks`: one layer's K or V bytes of one block, as uint8."""
        block, rest = divmod(index, 2 * self.num_layers)
        layer, kv = divmod(rest, 2)
        return self.caches[layer][kv][blocks[block]].view(-1).view(torch.uint8)

    def load(self, slot: int, adapter: LoRAAdapter, blocks: list[int]) -> None:
        """Write an adapter's weights into the pages of `blocks` and point the slot's page tables at them."""
        for layer in range(self.num_layers):
            for kind in FUSED:
                self.ranks[layer][kind][slot] = 0
                for table in self.tables[layer][kind]:
                    table[slot] = 0
        self.pieces[slot] = {}
        dense = self._dense_rows(adapter)
        index = 0
        for layer, kind, part, rows, per_page in self._pieces(adapter):
            data, pages = dense[layer, kind, part].view(torch.uint8), []
            for first in range(0, rows, per_page):
                chunk = data[first:first + per_page]
                target = self.page(blocks, index)
                target[:chunk.numel()].view(chunk.shape).copy_(chunk)
                self.tables[layer][kind][int(part == "b")][slot, len(pages)] = target.data_ptr()
                pages.append(index)
                index += 1
            self.pieces[slot][layer, kind, part] = pages
        for (layer, kind), ranks in self._shapes(adapter).items():
            self.ranks[layer][kind][slot] = torch.tensor(ranks)
        self.kinds[slot] = frozenset(k for k, ps in FUSED.items() if any(p in ps for _, p in adapter.weights))
        self.blocks[slot] = list(blocks)

    def _dense_rows(self, adapter: LoRAAdapter) -> dict[tuple[int, str, str], torch.Tensor]:
        """Each piece's rows in the model's dtype: A [in, a_width] (the projections' columns one after the other),
        B's tiles [rows, TILE] (the last tile of a projection padded with zeros)."""
        rows = {}
        for (layer, kind), ranks in self._shapes(adapter).items():
            a = torch.zeros(self.in_features[kind], self.a_width(ranks), dtype=self.dtype)
            tiles, column = [], 0
            for projection, rank in zip(FUSED[kind], ranks):
                if rank == 0:
                    continue
                pa, pb = adapter.weights[layer, projection]
                a[:, column:column + rank] = pa.T
                column += rank
                bt = pb.T.to(self.dtype)  # [rank, out]
                width = bt.shape[1]
                padded = torch.zeros(rank, -(-width // TILE) * TILE, dtype=self.dtype)
                padded[:, :width] = bt
                tiles.append(padded.view(rank, -1, TILE).transpose(0, 1).reshape(-1, TILE))  # tile by tile
            rows[layer, kind, "a"] = a
            rows[layer, kind, "b"] = torch.cat(tiles)
        return rows

    def dense(self, layer: int, kind: str, slots: slice, only: set[int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' A [S, in, W] and B [S, W, out] read back from their pages (zeros where no adapter targets the
        matmul, and for slots not in `only`: an evicted adapter's pages may hold K/V now): the torch path's
        operands."""
        widths, width = self.widths[kind], self.row_widths[kind]
        a = torch.zeros(slots.stop - slots.start, self.in_features[kind], width, dtype=self.dtype)
        b = torch.zeros(slots.stop - slots.start, width, sum(widths), dtype=self.dtype)
        for i, slot in enumerate(range(slots.start, slots.stop)):
            if (layer, kind, "a") not in self.pieces[slot] or (only is not None and slot not in only):
                continue
            ranks = self.ranks[layer][kind][slot].tolist()
            a[i, :, :self.a_width(ranks)] = self._read(slot, layer, kind, "a", ranks, self.in_features[kind])
            tiles = self._read(slot, layer, kind, "b", ranks, self._b_rows(kind, ranks))
            start = column = 0
            for w, rank in zip(widths, ranks):
                n = -(-w // TILE)
                if rank:
                    block = tiles[:n * rank].view(n, rank, TILE).transpose(0, 1).reshape(rank, -1)[:, :w]
                    b[i, column:column + rank, start:start + w] = block
                tiles, start, column = tiles[n * rank:], start + w, column + rank
        return a, b

    def _read(self, slot: int, layer: int, kind: str, part: str, ranks: list[int], rows: int) -> torch.Tensor:
        """A piece's rows [rows, its row length] from its pages."""
        per_page, out = self.rows_per_page(part, ranks), []
        width = self.a_width(ranks) if part == "a" else TILE
        for n, index in enumerate(self.pieces[slot][layer, kind, part]):
            count = min(per_page, rows - n * per_page)
            page = self.page(self.blocks[slot], index)
            out.append(page[:count * width * self.dtype.itemsize].view(self.dtype).view(count, width))
        return torch.cat(out)

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, layer: int, kind: str, batch: LoRABatch) -> torch.Tensor:
        """out[t] += B_slot(t) (A_slot(t) x[t]) for every token with an adapter, in place; returns out."""
        if self.ext is not None and x.dtype == out.dtype == self.dtype and x.stride(1) == out.stride(1) == 1:
            a_pages, b_pages = self.tables[layer][kind]
            self.ext.lora_sgmv(out, x, a_pages, b_pages, batch.tokens, batch.starts, batch.slots,
                               self.ranks[layer][kind], self.max_rank, self.widths[kind], self.row_widths[kind],
                               self.page_bytes)
            return out
        a, b = self.dense(layer, kind, batch.padded[0], set(batch.slots.tolist()))
        return self.add_delta_padded(out, x, a, b, batch, slice(0, len(a)))

    @staticmethod
    def add_delta_padded(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         batch: LoRABatch, slots: slice | None = None) -> torch.Tensor:
        """The torch path (and the kernel's reference): gather each segment's tokens padded to the longest, `bmm` by
        A, zero the pads, `bmm` by B, add back. A and B are indexed by `slots` (default: the batch's slot range)."""
        first, rows, mask = batch.padded
        slots = first if slots is None else slots
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
