"""The SGMV kernel (csrc/lora_sgmv.cpp) against the torch path it replaces: random shapes, empty and one-token
segments, many slots, steps whose tokens have no adapter, adapters of smaller ranks or fewer projections, float32 and
bfloat16; the weights read from pages (as the KV cache's blocks hold them) in shuffled order, NaN around them."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model import kernels
from pagedllm.model.lora import TILE, LoRABatch, LoRAStack

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"C++ kernels unavailable: {kernels.build_error()}")


def reference(out, x, a, b, batch, rank, widths):
    """The delta in float64 with B's zeros outside each projection's rank rows (what the kernel reads)."""
    out = out.double().clone()
    tokens = batch.tokens.tolist()
    for s, slot in enumerate(batch.slots.tolist()):
        rows = tokens[batch.starts[s]:batch.starts[s + 1]]
        h = x[rows].double() @ a[slot].double()
        start = 0
        for p, width in enumerate(widths):
            cols = slice(start, start + width)
            out[rows, cols] += h[:, p * rank:(p + 1) * rank] @ b[slot, p * rank:(p + 1) * rank, cols].double()
            start += width
    return out


def problem(seed, tokens, in_features, widths, rank, num_slots, token_slots, dtype, full_rank=True):
    """x, out, and a stack as LoRAStack holds it: A side by side, B block-diagonal, each slot's projections of rank
    `rank` (or, with full_rank False, of random ranks from 0 to `rank`, zeros beyond); the slots' ranks [slots, n]."""
    g = torch.Generator().manual_seed(seed)
    n = len(widths)
    width = -(-n * rank // 16) * 16
    ranks = torch.full((num_slots, n), rank) if full_rank else torch.randint(0, rank + 1, (num_slots, n), generator=g)
    x = torch.randn(tokens, in_features, generator=g).to(dtype)
    out = torch.randn(tokens, sum(widths), generator=g).to(dtype)
    a = torch.zeros(num_slots, in_features, width, dtype=dtype)
    b = torch.zeros(num_slots, width, sum(widths), dtype=dtype)
    start = 0
    for s in range(num_slots):
        start = 0
        for p, w in enumerate(widths):
            r = int(ranks[s, p])
            a[s, :, p * rank:p * rank + r] = torch.randn(in_features, r, generator=g).to(dtype)
            b[s, p * rank:p * rank + r, start:start + w] = torch.randn(r, w, generator=g).to(dtype)
            start += w
    batch = LoRABatch.build(torch.tensor(token_slots, dtype=torch.int64), dtype)
    return out, x, a, b, batch, ranks


class Pages:
    """Slots' A and B laid out as LoRAStack writes them into KV blocks, written independently here: per slot, A's
    `in` rows of its ranks side by side (rounded up to 16), then B's rows, per projection and tile of TILE columns its
    rank rows; rows packed into pages of `page_elems` (a row never across two), the pages in a shuffled pool filled
    with NaN elsewhere; page tables of addresses [slots, pages]."""

    def __init__(self, a, b, ranks, rank, widths, seed=0):
        slots, in_features, width = a.shape
        self.W = width
        self.page_elems = max(width, TILE) * 3 + 16  # 3 rows of the widest kind and some bytes left over
        self.page_bytes = self.page_elems * a.element_size()
        pieces = [self.rows(a[s], b[s], ranks[s].tolist(), rank, widths) for s in range(slots)]
        counts = [[-(-len(rows) // (self.page_elems // rows.shape[1])) if len(rows) else 0 for rows in piece]
                  for piece in pieces]
        total = sum(map(sum, counts))
        self.pool = torch.full((total, self.page_elems), float("nan"), dtype=a.dtype)
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
        self.a_pages = torch.zeros(slots, max(c[0] for c in counts), dtype=torch.int64)
        self.b_pages = torch.zeros(slots, max(max(c[1] for c in counts), 1), dtype=torch.int64)
        for s, piece in enumerate(pieces):
            for rows, table in zip(piece, (self.a_pages, self.b_pages)):
                per_page = self.page_elems // max(rows.shape[1], 1)
                for i, first in enumerate(range(0, len(rows), per_page)):
                    chunk, page = rows[first:first + per_page], self.pool[order.pop()]
                    page[:chunk.numel()] = chunk.reshape(-1)
                    table[s, i] = page.data_ptr()

    @staticmethod
    def rows(a, b, ranks, rank, widths):
        """One slot's A rows [in, sum(ranks) rounded to 16] and B rows [tiles x ranks, TILE]."""
        a_rows = torch.cat([a[:, p * rank:p * rank + r] for p, r in enumerate(ranks)], 1)
        a_rows = torch.nn.functional.pad(a_rows, (0, -a_rows.shape[1] % 16)) if a_rows.shape[1] else a_rows
        tiles, start = [], 0
        for p, (w, r) in enumerate(zip(widths, ranks)):
            bt = torch.nn.functional.pad(b[p * rank:p * rank + r, start:start + w], (0, -w % TILE))
            tiles.append(bt.view(r, -1, TILE).transpose(0, 1).reshape(-1, TILE) if r else bt.new_zeros(0, TILE))
            start += w
        return a_rows if a_rows.shape[1] else a_rows.new_zeros(0, 16), torch.cat(tiles)


def run(out, x, a, b, batch, ranks, rank, widths):
    pages = Pages(a, b, ranks, rank, widths)
    got = out.clone()
    ext.lora_sgmv(got, x, pages.a_pages, pages.b_pages, batch.tokens, batch.starts, batch.slots, ranks, rank, widths,
                  pages.W, pages.page_bytes)
    return got


CASES = [  # tokens, in, projection widths, rank, slots, each token's slot
    (1, 64, [64, 32, 32], 16, 3, [2]),  # one token
    (7, 40, [24, 8, 8], 8, 4, [3, -1, 0, 3, 3, -1, 0]),  # widths not multiples of 16, tokens of no adapter
    (37, 96, [130, 70], 16, 8, [i % 9 - 1 for i in range(37)]),  # many slots, tails of columns
    (70, 33, [100], 4, 2, [1] * 70),  # one long segment over many tiles, odd in_features
    (20, 64, [64], 40, 5, [4, 0] * 10),  # W = 48 > 40: padded rank columns
    (9, 16, [16, 16, 16], 32, 6, [5, 5, 2, 2, 2, 1, 1, 1, 1]),  # W = 96: shrink in two column blocks
]


@pytest.mark.parametrize("full_rank", [True, False], ids=["max-rank", "mixed-ranks"])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference_float32(case, full_rank):
    tokens, in_features, widths, rank, num_slots, token_slots = case
    out, x, a, b, batch, ranks = problem(sum(widths) + tokens, tokens, in_features, widths, rank, num_slots,
                                         token_slots, torch.float32, full_rank)
    got = run(out, x, a, b, batch, ranks, rank, widths)
    torch.testing.assert_close(got.double(), reference(out, x, a, b, batch, rank, widths), rtol=1e-5, atol=1e-4)
    no_adapter = [t for t, slot in enumerate(token_slots) if slot < 0]
    assert torch.equal(got[no_adapter], out[no_adapter])  # rows of no adapter untouched
    torch.testing.assert_close(got, LoRAStack.add_delta_padded(out.clone(), x, a, b, batch), rtol=1e-5, atol=1e-4)
    # the pool is NaN outside the rows written (and A's rows of a slot's ranks only): the kernel reads nothing else
    assert not got.isnan().any()


@pytest.mark.parametrize("case", CASES[1:4])
def test_kernel_equals_reference_bfloat16(case):
    tokens, in_features, widths, rank, num_slots, token_slots = case
    out, x, a, b, batch, ranks = problem(7, tokens, in_features, widths, rank, num_slots, token_slots,
                                         torch.bfloat16, False)
    got = run(out, x, a, b, batch, ranks, rank, widths)
    assert got.dtype == torch.bfloat16
    expected = reference(out, x, a, b, batch, rank, widths)
    # fp32 sums, one bf16 rounding of out + delta: within half a bf16 unit of the exact sum, plus fp32 noise
    torch.testing.assert_close(got.double(), expected, rtol=2 ** -8, atol=1e-3)


def test_empty_segments_and_a_step_without_adapters():
    out, x, a, b, _, ranks = problem(3, 5, 32, [32], 16, 4, [0] * 5, torch.float32)
    assert LoRABatch.build(torch.full((5,), -1), torch.float32) is None  # no adapter token: no batch at all
    pages, empty = Pages(a, b, ranks, 16, [32]), torch.zeros(0, dtype=torch.int64)
    got = out.clone()
    ext.lora_sgmv(got, x, pages.a_pages, pages.b_pages, empty, torch.zeros(1, dtype=torch.int64), empty, ranks, 16,
                  [32], pages.W, pages.page_bytes)
    assert torch.equal(got, out)
    # segments with no token between others (slots 1 and 2 hold nothing this step)
    tokens, starts, slots = torch.tensor([4, 0, 2]), torch.tensor([0, 2, 2, 2, 3]), torch.tensor([0, 1, 2, 3])
    ext.lora_sgmv(got, x, pages.a_pages, pages.b_pages, tokens, starts, slots, ranks, 16, [32], pages.W,
                  pages.page_bytes)
    batch = LoRABatch(tokens, torch.tensor([0, 2, 3]), torch.tensor([0, 3]), torch.float32)
    torch.testing.assert_close(got.double(), reference(out, x, a, b, batch, 16, [32]), rtol=1e-5, atol=1e-4)


def test_bad_arguments_are_refused():
    out, x, a, b, batch, ranks = problem(4, 3, 32, [32], 16, 2, [0, 1, 1], torch.float32)
    pages = Pages(a, b, ranks, 16, [32])

    def call(out=out, tokens=batch.tokens, slots=batch.slots, ranks=ranks, a_pages=pages.a_pages,
             page_bytes=pages.page_bytes):
        ext.lora_sgmv(out, x, a_pages, pages.b_pages, tokens, batch.starts, slots, ranks, 16, [32], pages.W,
                      page_bytes)

    with pytest.raises(RuntimeError, match="slot"):
        call(slots=torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="token"):
        call(tokens=torch.tensor([0, 1, 9]))
    with pytest.raises(RuntimeError, match="dtype"):
        call(out=out.double())
    with pytest.raises(RuntimeError, match="rank"):
        call(ranks=ranks + 1)
    with pytest.raises(RuntimeError, match="page of A is missing"):  # a slot in the step whose pages are not set
        call(a_pages=pages.a_pages * torch.tensor([[1], [0]]))
    with pytest.raises(RuntimeError, match="page must hold a row"):
        call(page_bytes=4 * 16)
