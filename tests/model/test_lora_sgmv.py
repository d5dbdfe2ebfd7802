"""The SGMV kernel (csrc/lora_sgmv.cpp) against the torch path it replaces: random shapes, empty and one-token
segments, many slots, steps whose tokens have no adapter, adapters of smaller ranks or fewer projections, float32 and
bfloat16."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model import kernels
from pagedllm.model.lora import LoRABatch, LoRAStack

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


def run(out, x, a, b, batch, ranks, rank, widths):
    got = out.clone()
    ext.lora_sgmv(got, x, a, b, batch.tokens, batch.starts, batch.slots, ranks, rank, widths)
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
    # the kernel reads no weight outside each projection's rank: NaN there changes nothing
    poisoned = run(out, x, a.masked_fill(a == 0, float("nan")), b.masked_fill(b == 0, float("nan")), batch, ranks,
                   rank, widths)
    assert torch.equal(poisoned, got)


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
    empty = torch.zeros(0, dtype=torch.int64)
    got = out.clone()
    ext.lora_sgmv(got, x, a, b, empty, torch.zeros(1, dtype=torch.int64), empty, ranks, 16, [32])
    assert torch.equal(got, out)
    # segments with no token between others (slots 1 and 2 hold nothing this step)
    tokens, starts, slots = torch.tensor([4, 0, 2]), torch.tensor([0, 2, 2, 2, 3]), torch.tensor([0, 1, 2, 3])
    ext.lora_sgmv(got, x, a, b, tokens, starts, slots, ranks, 16, [32])
    batch = LoRABatch(tokens, torch.tensor([0, 2, 3]), torch.tensor([0, 3]), torch.float32)
    torch.testing.assert_close(got.double(), reference(out, x, a, b, batch, 16, [32]), rtol=1e-5, atol=1e-4)


def test_bad_arguments_are_refused():
    out, x, a, b, batch, ranks = problem(4, 3, 32, [32], 16, 2, [0, 1, 1], torch.float32)
    with pytest.raises(RuntimeError, match="slot"):
        ext.lora_sgmv(out, x, a, b, batch.tokens, batch.starts, torch.tensor([0, 5]), ranks, 16, [32])
    with pytest.raises(RuntimeError, match="token"):
        ext.lora_sgmv(out, x, a, b, torch.tensor([0, 1, 9]), batch.starts, batch.slots, ranks, 16, [32])
    with pytest.raises(RuntimeError, match="dtype"):
        ext.lora_sgmv(out.double(), x, a, b, batch.tokens, batch.starts, batch.slots, ranks, 16, [32])
    with pytest.raises(RuntimeError, match="rank"):
        ext.lora_sgmv(out, x, a, b, batch.tokens, batch.starts, batch.slots, ranks + 1, 16, [32])
