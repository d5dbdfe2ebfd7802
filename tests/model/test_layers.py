"""The fused C++ norm / SwiGLU / rotary kernels equal the torch code they replace (which follows transformers)."""

from __future__ import annotations

import pytest
import torch
from conftest import write_gguf

from pagedllm.model import kernels, weight_forms
from pagedllm.model.layers import (
    BF16_GEMM_MAX_ROWS,
    INT4_MAX_ROWS,
    INT4_MAX_ROWS_WITHOUT_BF16_GEMM,
    Bf16Weight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    RotaryEmbedding,
    add_rms_norm,
    linear,
    rms_norm,
    swiglu,
)


def skip_unless_int8_exact() -> None:
    if not kernels.int8_products_exact():
        pytest.skip("no VNNI here: oneDNN's int8 products saturate (the engine runs no int8 on such CPUs)")


@pytest.fixture(scope="module")
def ext():
    ext = kernels.load()
    if ext is None:
        pytest.skip(f"kernels did not build: {kernels.build_error()}")
    return ext


def assert_matches(fused: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: equal up to summation order. bf16: the same roundings, so rarely apart, and then by a bf16 step or two
    (a different sum can flip one rounding, and the next rounding can follow it)."""
    assert fused.dtype == ref.dtype and fused.shape == ref.shape
    if fused.dtype == torch.float32:
        torch.testing.assert_close(fused, ref, rtol=2e-6, atol=2e-6)
    else:
        torch.testing.assert_close(fused.float(), ref.float(), rtol=2 ** -6, atol=1e-6)
        assert (fused != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 576), (300, 576), (5, 100), (3, 7)])
def test_add_rms_norm(ext, dtype: torch.dtype, rows: int, hidden: int) -> None:
    """Widths beyond multiples of 32 take the kernels' one-by-one tail."""
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    ref_residual = residual.clone()
    ref = add_rms_norm(x, ref_residual, weight, 1e-5)
    fused_residual = residual.clone()
    fused = add_rms_norm(x, fused_residual, weight, 1e-5, ext)
    assert torch.equal(fused_residual, ref_residual)  # the add is one rounding either way
    assert torch.equal(ref_residual, (residual + x))
    assert_matches(fused, ref)
    assert_matches(add_rms_norm(None, residual, weight, 1e-5, ext), rms_norm(residual, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 40, 5])
def test_swiglu(ext, dtype: torch.dtype, width: int) -> None:
    gate_up = (torch.randn(33, 2 * width, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturation and zero
    assert_matches(swiglu(gate_up, ext), swiglu(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 16])
def test_rotary_in_place(ext, dtype: torch.dtype, head_dim: int) -> None:
    g = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    d = head_dim  # q and k are strided views of one qkv row, as in the model
    qkv = torch.randn(19, (9 + 3 + 3) * d, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (19,), generator=g)
    q, k = qkv[:, :9 * d].view(19, 9, d), qkv[:, 9 * d:12 * d].view(19, 3, d)
    ref_q, ref_k = rotary(positions, q, k)
    v_before = qkv[:, 12 * d:].clone()
    out_q, out_k = rotary(positions, q, k, ext)
    assert out_q.data_ptr() == q.data_ptr()
    assert_matches(out_q, ref_q)
    assert_matches(out_k, ref_k)
    assert torch.equal(qkv[:, 12 * d:], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_come_through_as_in_torch(ext, dtype: torch.dtype) -> None:
    """In the vector part of a row (the first 32 values) and in its tail: the bf16 rounding keeps them."""
    g = torch.Generator().manual_seed(4)
    residual = torch.randn(3, 40, generator=g).to(dtype)
    residual[0, 5], residual[1, 35] = float("inf"), float("nan")  # a row of 0s and one NaN; a row of NaNs
    weight = (torch.rand(40, generator=g) + 0.5).to(dtype)
    fused, ref = add_rms_norm(None, residual, weight, 1e-5, ext), rms_norm(residual, weight, 1e-5)
    torch.testing.assert_close(fused, ref, rtol=2 ** -6, atol=1e-6, equal_nan=True)
    gate_up = torch.randn(2, 80, generator=g).to(dtype)
    gate_up[0, [3, 4, 35, 36]] = torch.tensor([float("nan"), float("inf"), float("nan"), float("inf")], dtype=dtype)
    torch.testing.assert_close(swiglu(gate_up, ext), swiglu(gate_up), rtol=2 ** -6, atol=1e-6, equal_nan=True)


def test_bad_input_is_an_error_not_a_crash(ext) -> None:
    rotary = RotaryEmbedding(64, 16, 10000.0, None, torch.float32)
    q = torch.randn(2, 1, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        rotary(torch.tensor([0, 16]), q, q.clone(), ext)
    with pytest.raises(RuntimeError, match="even"):
        ext.silu_mul(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="weight"):
        ext.add_rms_norm(None, torch.randn(2, 8), torch.ones(4), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_logsumexp(ext, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(5, 5000, generator=g) * 4).to(dtype)
    logits[1, 100:140] = 50.0  # ties: the lower ids come first, as argmax and a stable sort give
    values, ids, lse = ext.top_k_logsumexp(logits, 16)
    ref = logits.float()
    torch.testing.assert_close(lse, ref.logsumexp(-1))
    order = torch.sort(-ref, dim=-1, stable=True)
    assert torch.equal(values, -order.values[:, :16]) and torch.equal(ids, order.indices[:, :16])
    assert ids[1].tolist() == list(range(100, 116))


@pytest.mark.parametrize(("hidden_dtype", "weight_dtype"), [(torch.bfloat16, torch.bfloat16),
                                                            (torch.float32, torch.bfloat16),
                                                            (torch.float32, torch.float32)])
def test_rescore_top_k_recomputes_the_candidates_and_their_logsumexp(ext, hidden_dtype, weight_dtype) -> None:
    """The greedy pass's candidates in fp32 (hidden . weight[id], as a gather and an einsum give them), -inf where
    top_k_logsumexp had none (a grammar's forbidden tokens), and the logsumexp of the rounded logits with those
    candidates' terms swapped for their exact ones: the full fp32 logsumexp where the rest was rounded alike."""
    g = torch.Generator().manual_seed(4)
    hidden = (torch.randn(6, 72, generator=g) * 2).to(hidden_dtype)  # 72: 16-lane blocks and a tail
    weight = torch.randn(3000, 72, generator=g).to(weight_dtype)
    full = hidden.float() @ weight.float().T
    rounded = full.bfloat16()
    rounded[5, 16:] = float("-inf")  # a grammar allowed 16 tokens on row 5, 10 on row 4
    rounded[4, 10:] = float("-inf")
    values, ids, lse = ext.top_k_logsumexp(rounded, 16)
    exact, new_lse = ext.rescore_top_k(hidden, weight, values, ids, lse)
    rows = weight.index_select(0, ids.reshape(-1)).view(6, 16, -1)
    gathered = torch.einsum("sd,skd->sk", hidden.float(), rows.float())
    torch.testing.assert_close(ext.exact_logits(hidden, weight, ids), gathered, rtol=1e-6, atol=1e-5)
    allowed = values != float("-inf")
    assert torch.equal(exact[allowed], ext.exact_logits(hidden, weight, ids)[allowed])
    assert (exact[~allowed] == float("-inf")).all() and (~allowed).sum() == 6
    # what compute_logits makes of the same rows: its allowed candidates swapped in (row 4's -inf ones carry id 0)
    swapped = torch.stack([row.float().scatter(0, i[a], e[a]) for row, i, e, a in zip(rounded, ids, exact, allowed)])
    torch.testing.assert_close(new_lse, swapped.logsumexp(-1), rtol=1e-5, atol=1e-5)
    assert (new_lse[:4] - full[:4].logsumexp(-1)).abs().max() < (lse[:4] - full[:4].logsumexp(-1)).abs().max()
    for bad, match in [(ids + 3000, "tokens below"), (ids - 3000, "tokens below"), (ids.int(), "int64"),
                       (ids[:5], "int64 \\[6, k\\]")]:
        with pytest.raises(RuntimeError, match=match):
            ext.rescore_top_k(hidden, weight, values, bad, lse)
    with pytest.raises(RuntimeError, match="weight"):
        ext.exact_logits(hidden, weight[:, :64], ids)
    with pytest.raises(RuntimeError, match="values"):
        ext.rescore_top_k(hidden, weight, values[:, :8], ids, lse)
    with pytest.raises(RuntimeError, match="lse"):
        ext.rescore_top_k(hidden, weight, values, ids, lse[:5])


def test_greedy_logits_over_the_kept_buffer_equal_fresh_ones_whatever_the_call_sizes(tiny_model_dir) -> None:
    """top_logits writes the int8 lm_head's logits into a buffer kept across calls (a fresh one past 32 MiB is mapped
    and faulted in at every step): calls that grow, shrink and grow it again each give what a fresh product gives."""
    from pagedllm.model.llama import LlamaModel
    from pagedllm.model.loader import load_model

    loaded = load_model(tiny_model_dir, torch.float32)
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, int8=["lm_head"])
    head = model.lm_head_weight
    if model.ext is None or head.int8 is None or head.int8.packed is None:
        pytest.skip("no int8 kernel for the lm_head here")
    head.route = ((2 ** 62, "int8"),)
    kept = []
    for rows in (9, 3, 70, 5):
        hidden = torch.randn(rows, loaded.config.hidden_size, generator=torch.Generator().manual_seed(rows)) * 3
        values, ids, lse = model.top_logits(hidden)
        assert torch.equal(model._logits_buffer[:rows], head.mm(hidden)), rows  # the logits themselves
        fresh = model.ext.top_k_logsumexp(head.mm(hidden), values.shape[1])
        exact = model._exact_logits(hidden, fresh[1])
        assert torch.equal(ids, fresh[1]) and torch.equal(values, exact), rows
        kept.append(model._logits_buffer.data_ptr())
    assert kept[0] == kept[1] and kept[2] == kept[3]  # grown once for 70 rows, then reused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_equals_full_logits(tiny_model_dir, dtype: torch.dtype) -> None:
    """LlamaModel.top_logits + sample_greedy_from_top give compute_logits + sample's greedy token and logprob."""
    from pagedllm.model.llama import LlamaModel
    from pagedllm.model.loader import load_model
    from pagedllm.model.sampler import SamplingBatch, sample, sample_greedy_from_top
    from pagedllm.sampling_params import SamplingParams

    loaded = load_model(tiny_model_dir, dtype)
    model = LlamaModel(loaded.config, loaded.weights, dtype)
    if model.ext is None:
        pytest.skip("kernels did not build")
    hidden = (torch.randn(9, loaded.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 9, [[1]] * 9, [[]] * 9, [None] * 9,
                                loaded.config.vocab_size)
    assert batch.is_plain_greedy
    slow = sample(model.compute_logits(hidden), batch)
    fast = sample_greedy_from_top(*model.top_logits(hidden))
    assert torch.equal(fast.token_ids, slow.token_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=1e-5, atol=1e-5)
    # min_tokens: each row's favourite as its "EOS" is banned on rows 0-5 (not yet at min_tokens), 6-8 are free
    favourite = slow.token_ids.tolist()
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[favourite[i], 7]) for i in range(9)]
    banned = SamplingBatch.build(params, [[1]] * 9, [[]] * 6 + [[5, 5]] * 3, [None] * 9, loaded.config.vocab_size)
    assert banned.is_plain_greedy and banned.banned is not None
    slow = sample(model.compute_logits(hidden), banned)
    fast = sample_greedy_from_top(*model.top_logits(hidden), banned.banned)
    assert torch.equal(fast.token_ids, slow.token_ids)
    assert [t != f for t, f in zip(fast.token_ids.tolist(), favourite)] == [True] * 6 + [False] * 3
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_under_a_grammar_mask(tiny_model_dir, dtype: torch.dtype) -> None:
    """With a grammar on some rows, the fast path picks the best allowed token and its logprob under the mask, as
    the full path does: rows allowed one token, three tokens (fewer than the candidates kept), every other token
    (the model's favourite forbidden), a mask whose first 4,096 tokens are all forbidden, and an unconstrained row."""
    from pagedllm.model.llama import LlamaModel
    from pagedllm.model.loader import load_model
    from pagedllm.model.sampler import GrammarMask, SamplingBatch, sample, sample_greedy_from_top
    from pagedllm.sampling_params import SamplingParams

    loaded = load_model(tiny_model_dir, dtype)
    model = LlamaModel(loaded.config, loaded.weights, dtype)
    if model.ext is None:
        pytest.skip("kernels did not build")
    vocab = loaded.config.vocab_size
    hidden = (torch.randn(5, loaded.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    favourite = model.compute_logits(hidden).argmax(-1)
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    allowed[0, 70] = True
    allowed[1, [5, 900, vocab - 1]] = True
    allowed[2] = True
    allowed[2, favourite[2]] = False
    allowed[3, 4096:] = True
    packed = torch.zeros(4, (vocab + 31) // 32 * 32, dtype=torch.bool)
    packed[:, :vocab] = allowed
    bitmask = (packed.view(4, -1, 8).long() << torch.arange(8)).sum(-1).to(torch.uint8).view(torch.int32)  # bit t%8
    grammar = GrammarMask(torch.tensor([0, 1, 2, 4]), bitmask)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 5, [[1]] * 5, [[]] * 5, [None] * 5, vocab,
                                grammar=grammar)
    assert batch.is_plain_greedy
    slow = sample(model.compute_logits(hidden), batch)
    fast = sample_greedy_from_top(*model.top_logits(hidden, grammar))
    assert torch.equal(fast.token_ids, slow.token_ids)
    assert fast.token_ids[0] == 70 and fast.token_ids[1] in (5, 900, vocab - 1) and fast.token_ids[2] != favourite[2]
    assert fast.token_ids[3] == favourite[3] and fast.token_ids[4] >= 4096
    # In bf16 the full path recomputes in fp32 the top candidates of the unmasked row, the fast path those of the
    # masked one: an allowed token outside the former keeps its bf16-rounded logit there.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fast.logprobs, slow.logprobs, rtol=tol, atol=tol)


def random_int4(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit values with an fp16 scale and min per 32 inputs, as a GGUF Q4_1 weight has."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = (torch.rand(rows, cols // 32, generator=g) * 0.02).half().float()
    min_ = (-torch.rand(rows, cols // 32, generator=g) * 0.16).half().float()
    return q, scale, min_


def dequantized(q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    return (q.float().view(rows, cols // 32, 32) * scale[..., None] + min_[..., None]).view(rows, cols)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33])
def test_int4_matmul_equals_the_dequantized_weight(ext, rows: int) -> None:
    """The int4 kernel computes x @ w.T with w = q * scale + min exactly (products and sums in fp32): its output is
    the bf16 rounding of the fp32 result, except where an fp32 sum lands next to a rounding boundary. Each row
    alone gives the same as in the batch (batch-invariant), for every block of rows the kernel takes at once (blocks
    of up to 8 rows, their sums in registers)."""
    if not ext.int4_linear_supported():
        pytest.skip("no AVX512-BF16 on this CPU")
    q, scale, min_ = random_int4(96, 576, rows)
    weight = Int4Weight(q, scale, min_, ext)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(7)).bfloat16()
    ref = x.float() @ dequantized(q, scale, min_).T
    out = weight.mm(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-5)
    assert (out != ref.bfloat16()).float().mean() < 0.01
    for r in range(rows):
        assert torch.equal(weight.mm(x[r:r + 1]), out[r:r + 1])


def test_int4_bad_input_is_an_error_not_a_crash(ext) -> None:
    if not ext.int4_linear_supported():
        pytest.skip("no AVX512-BF16 on this CPU")
    weight = Int4Weight(*random_int4(32, 64, 0), ext)
    with pytest.raises(RuntimeError, match="columns"):
        weight.mm(torch.zeros(2, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        weight.mm(torch.zeros(2, 64))


def test_linear_takes_int4_for_small_batches_only(ext) -> None:
    """`linear` runs a PackedWeight's 4-bit form up to INT4_MAX_ROWS_WITHOUT_BF16_GEMM rows when it has no bf16_gemm
    form, and oneDNN's bf16 matmul beyond: give the two different weights and see which one answered."""
    if not (PackedWeight.native(torch.bfloat16) and ext.int4_linear_supported()):
        pytest.skip("no native bf16 matmul on this CPU")
    int4_rows = INT4_MAX_ROWS_WITHOUT_BF16_GEMM
    q, scale, min_ = random_int4(64, 128, 0)
    other = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).bfloat16() * 0.01
    weight = PackedWeight(other, Int4Weight(q, scale, min_, ext))
    bias = torch.randn(64).bfloat16()
    x = torch.randn(int4_rows + 1, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    small, large = linear(x[:int4_rows], weight, bias), linear(x, weight, bias)
    by_int4 = x.float() @ dequantized(q, scale, min_).T + bias.float()
    by_other = x.float() @ other.float().T + bias.float()
    assert (by_int4 - by_other).abs().mean() > 0.1  # the two answers are far apart
    tol = dict(rtol=2 ** -7, atol=2 ** -7)  # two bf16 roundings (matmul, bias) of values up to ~2
    torch.testing.assert_close(small.float(), by_int4[:int4_rows], **tol)
    torch.testing.assert_close(large.float(), by_other, **tol)


@pytest.mark.parametrize(("rows", "inputs"), [(1, 64), (5, 576), (6, 576), (7, 1536), (13, 576), (64, 576),
                                            (130, 98)])
def test_bf16_gemm_equals_the_product(ext, rows: int, inputs: int) -> None:
    """bf16_gemm sums x @ w.T in fp32 over all of K and rounds once: the bf16 rounding of the fp32 product, except
    where a sum lands next to a rounding boundary. A row alone gives the same bits as in any batch (each row's sums
    run in the same order whatever block of rows, or thread, takes it)."""
    if not ext.bf16_gemm_supported():
        pytest.skip("no AVX512-BF16 on this CPU")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(192, inputs, generator=g) * 0.05).bfloat16()  # 3 panels: fewer than the threads want
    x = torch.randn(rows, inputs, generator=g).bfloat16()
    weight = Bf16Weight(w, ext)
    ref = x.float() @ w.float().T
    out = weight.mm(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 192)
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-5)
    assert (out != ref.bfloat16()).float().mean() < 0.01
    for r in range(rows):
        assert torch.equal(weight.mm(x[r:r + 1]), out[r:r + 1])


def test_bf16_gemm_bad_input_is_an_error_not_a_crash(ext) -> None:
    if not ext.bf16_gemm_supported():
        pytest.skip("no AVX512-BF16 on this CPU")
    weight = Bf16Weight(torch.zeros(64, 32, dtype=torch.bfloat16), ext)
    with pytest.raises(RuntimeError, match="columns"):
        weight.mm(torch.zeros(2, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        weight.mm(torch.zeros(2, 32))
    with pytest.raises(RuntimeError, match="packed"):
        ext.bf16_gemm(torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(1, 16, 4, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize(("shape", "dtype", "ok"), [
    ((128, 576), torch.bfloat16, True),
    ((128, 576), torch.float32, False),  # bf16 weights only
    ((96, 576), torch.bfloat16, False),  # panels of 64 outputs
    ((128, 575), torch.bfloat16, False),  # pairs of inputs
])
def test_bf16_gemm_available(ext, shape: tuple[int, int], dtype: torch.dtype, ok: bool) -> None:
    w = torch.zeros(shape, dtype=dtype)
    assert Bf16Weight.available(w, ext) is (ok and ext.bf16_gemm_supported())
    assert not Bf16Weight.available(w, None)


def test_linear_takes_int4_then_the_bf16_kernel_then_onednn(ext) -> None:
    """`linear` runs a PackedWeight's 4-bit form up to INT4_MAX_ROWS rows, its bf16_gemm form up to
    BF16_GEMM_MAX_ROWS and oneDNN's matmul beyond: give three different weights and see which one answered. On an AMX
    CPU, whose tiles oneDNN's matmul runs on, the static route skips bf16_gemm: the 4-bit form up to
    INT4_MAX_ROWS_WITHOUT_BF16_GEMM, then oneDNN."""
    if not (PackedWeight.native(torch.bfloat16) and ext.int4_linear_supported() and ext.bf16_gemm_supported()):
        pytest.skip("no native bf16 matmul on this CPU")
    g = torch.Generator().manual_seed(3)
    q, scale, min_ = random_int4(64, 128, 0)
    onednn, own = ((torch.randn(64, 128, generator=g) * 0.01).bfloat16() for _ in range(2))
    weight = PackedWeight(onednn, Int4Weight(q, scale, min_, ext), bf16=Bf16Weight(own, ext))
    bias = torch.randn(64, generator=g).bfloat16()
    tol = dict(rtol=2 ** -7, atol=2 ** -7)  # two bf16 roundings (matmul, bias) of values up to ~2
    cases = [(INT4_MAX_ROWS, dequantized(q, scale, min_)), (INT4_MAX_ROWS + 1, own), (BF16_GEMM_MAX_ROWS, own),
             (BF16_GEMM_MAX_ROWS + 1, onednn)]
    if kernels.cpu_has_amx():
        cases = [(INT4_MAX_ROWS_WITHOUT_BF16_GEMM, dequantized(q, scale, min_)),
                 (INT4_MAX_ROWS_WITHOUT_BF16_GEMM + 1, onednn), (BF16_GEMM_MAX_ROWS, onednn)]
    for rows, w in cases:
        x = torch.randn(rows, 128, generator=g).bfloat16()
        answers = [x.float() @ other.float().T + bias.float()
                   for other in (dequantized(q, scale, min_), own, onednn)]
        assert min((a - b).abs().mean() for i, a in enumerate(answers) for b in answers[i + 1:]) > 0.1
        torch.testing.assert_close(linear(x, weight, bias).float(), x.float() @ w.float().T + bias.float(), **tol)


@pytest.mark.parametrize(("shape", "dtype", "fp16", "kernel"), [
    ((64, 128), torch.bfloat16, True, "int4_linear_supported"),
    ((64, 128), torch.float32, True, "int4_linear_f32_supported"),  # fp32 rows: the fp32 kernel
    ((64, 128), torch.float16, True, None),  # no kernel takes fp16 rows
    ((40, 128), torch.bfloat16, True, None),  # tiles of 16 rows
    ((48, 128), torch.float32, True, None),  # the fp32 kernel's tiles of 64
    ((64, 48), torch.bfloat16, True, None),  # groups of 32 inputs
    ((64, 128), torch.bfloat16, False, None),  # a scale that fp16 cannot hold exactly
])
def test_int4_available(ext, shape: tuple[int, int], dtype: torch.dtype, fp16: bool, kernel: str | None) -> None:
    q = torch.zeros(shape, dtype=torch.uint8)
    scale = torch.full((shape[0], max(1, shape[1] // 32)), 0.01 if fp16 else 1 / 3)
    scale = scale.half().float() if fp16 else scale
    ok = kernel is not None and getattr(ext, kernel)()
    assert Int4Weight.available(q, scale, torch.zeros_like(scale), dtype, ext) is ok
    assert not Int4Weight.available(q, scale, torch.zeros_like(scale), dtype, None)


@pytest.mark.parametrize("path", ["kernel", "int-mm-one-block", "int-mm-three-blocks", "int-mm-ragged-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33, 100])
def test_int8_matmul_is_the_quantized_product(ext, monkeypatch, dtype: torch.dtype, rows: int, path: str) -> None:
    """w8a8: the exact product of the int8 rows and weights, scaled back (so the only error is the quantisation),
    which stays within a few hundredths of the float product for well-spread values; the same from the int8_gemm
    kernel and from the torch._int_mm fallback, whether that runs over all output columns at once or a block of
    columns at a time."""
    if path == "kernel":
        if not ext.int8_gemm_supported():
            pytest.skip("no int8_gemm in this build")
    else:
        skip_unless_int8_exact()
        monkeypatch.setattr(Int8Weight, "kernel_available", staticmethod(lambda ext, in_features: False))
        block = {"one": 4096, "three": 16, "ragged": 20}[path.split("-")[2]]
        monkeypatch.setattr(weight_forms, "INT8_COLUMN_BLOCK", block)
    gen = torch.Generator().manual_seed(rows)
    w, x, bias = torch.randn(48, 64, generator=gen), torch.randn(rows, 64, generator=gen), torch.randn(48)
    weight = Int8Weight(w.to(dtype), ext)
    assert (weight.packed is not None) is (path == "kernel")
    if path != "kernel":
        assert len(weight.blocks) == -(-48 // weight_forms.INT8_COLUMN_BLOCK)
    out = weight.mm(x.to(dtype), bias.to(dtype))
    assert out.dtype == dtype and out.shape == (rows, 48)
    limit = ext.int8_gemm_input_max() if path == "kernel" else 127  # the activations' range: 64 on AVX2's kernel
    xs = x.to(dtype).float().abs().amax(1, keepdim=True) / limit
    xq = (x.to(dtype).float() / xs).round()
    wq = weight.int8_rows()
    assert torch.equal(wq, (w.to(dtype).float() * (1 / weight.scale[:, None])).round().to(torch.int8))
    exact = (xq.double() @ wq.double().T) * xs.double() * weight.scale.double() + bias.to(dtype).double()
    step = 1e-5 if dtype == torch.float32 else 2 ** -7  # the output's rounding
    torch.testing.assert_close(out.double(), exact, rtol=step, atol=step * exact.abs().max().item())
    rel = ((out.float() - (x @ w.T + bias)).norm() / (x @ w.T).norm()).item()
    assert rel < 0.03


@pytest.mark.parametrize("qmax", [127, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [576, 37, 1])
def test_quantize_rows_int8_rounds_each_row_to_its_scale(ext, dtype: torch.dtype, cols: int, qmax: int) -> None:
    """scale = amax / qmax per row (1 for a row of zeros), q = x * (1 / scale) rounded to nearest even, in fp32:
    127 for weights, the kernel's input range for activations (64 on AVX2 without VNNI)."""
    x = (torch.randn(70, cols, generator=torch.Generator().manual_seed(cols)) * torch.logspace(-3, 3, 70)[:, None])
    x[3] = 0
    x[5, :4] = torch.tensor([float(qmax), 2.5, 3.5, -2.5])[:cols]  # scale 1: exact halves, which round to even
    x = x.to(dtype)
    q, scale = ext.quantize_rows_int8(x, qmax) if qmax != 127 else ext.quantize_rows_int8(x)
    xf = x.float()
    ref_scale = xf.abs().amax(1) / qmax
    ref_scale[ref_scale == 0] = 1
    assert torch.equal(scale, ref_scale)
    assert q.dtype == torch.int8 and torch.equal(q, (xf * (1 / ref_scale)[:, None]).round().to(torch.int8))
    assert q[3].eq(0).all() and q.abs().amax(1)[torch.arange(70) != 3].eq(qmax).all()
    if cols >= 4:
        assert q[5, :4].tolist() == [qmax, 2, 4, -2]
    with pytest.raises(RuntimeError, match="qmax"):
        ext.quantize_rows_int8(x, 128)


def test_quantized_rows_stay_in_the_kernels_range_whatever_they_hold(ext) -> None:
    """A row with a NaN or an infinity (a model gone wrong) still quantises within +-qmax, so int8_gemm, which refuses
    values past its range, takes it: a step gives garbage for that row rather than failing for the whole batch."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[0, 3], x[1, 5], x[2, 7], x[2, 8] = float("nan"), float("inf"), float("-inf"), float("nan")
    limit = ext.int8_gemm_input_max() or 127
    q, _ = ext.quantize_rows_int8(x, limit)
    assert q.abs().max().item() <= limit
    assert q[0, 3] == -limit  # a NaN, clamped (unclamped: -128 from AVX-512's conversion, or whatever a cast gives)
    assert q[1, 5] == -limit and q[1].count_nonzero() == 1  # an infinite scale: inf * 0 is NaN, the rest 0
    assert q[2, 7] == q[2, 8] == -limit and q[2].count_nonzero() == 2
    assert torch.equal(q[3], ext.quantize_rows_int8(x[3:].contiguous(), limit)[0][0])  # finite rows as before
    if ext.int8_gemm_supported():
        acc = torch.empty(4, 100, dtype=torch.int32)
        ext.int8_gemm(q, Int8Weight.pack(random_int8((100, 64), 2)), None, None, None, acc)


def random_int8(shape: tuple[int, int], seed: int, limit: int = 127) -> torch.Tensor:
    """Uniform in [-limit, limit]: 127 for weights, the kernel's input range (int8_gemm_input_max) for activations."""
    return torch.randint(-limit, limit + 1, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("rows", "cols", "inputs"), [
    (1, 1000, 576), (3, 1000, 576), (16, 1000, 576), (17, 1000, 576), (100, 1000, 576), (300, 1000, 576),
    (7, 64, 1536), (13, 17, 4), (200, 2, 64),  # one panel, a partial one, a sliver
])
def test_int8_gemm_equals_the_exact_product(ext, rows: int, cols: int, inputs: int) -> None:
    """int8_gemm's int32 sums equal the int64 product of the int8 matrices exactly (every register block of rows and
    columns, the last panel's padding); its scaled output is the fp64 value of the same product rounded once to
    fp32 / bf16, the bits dequantize_int32 gives over those sums (the torch._int_mm path)."""
    if not ext.int8_gemm_supported():
        pytest.skip("no int8_gemm in this build")
    limit = ext.int8_gemm_input_max()
    q, w = random_int8((rows, inputs), rows, limit), random_int8((cols, inputs), cols + inputs)
    w[0, :] = 127  # the extremes the u8 offset must carry: 255 * -limit per product
    q[0, :] = -limit
    packed = Int8Weight.pack(w)
    assert packed.shape == (-(-cols // 64), inputs // 4, 4, 64)
    acc = torch.empty(rows, cols, dtype=torch.int32)
    ext.int8_gemm(q, packed, None, None, None, acc)
    exact = q.long() @ w.long().T
    assert torch.equal(acc.long(), exact)
    gen = torch.Generator().manual_seed(0)
    row_scale, col_scale = torch.rand(rows, generator=gen) / 100, torch.rand(cols, generator=gen) / 100
    bias = torch.randn(cols, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(rows, cols, dtype=dtype)
        ext.int8_gemm(q, packed, row_scale, col_scale, None, out)
        old = torch.empty_like(out)
        ext.dequantize_int32(acc, row_scale, col_scale, None, old)
        assert torch.equal(out, old)
        ref = exact.double() * row_scale.double()[:, None] * col_scale.double()
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -22 if dtype == torch.float32 else 2 ** -8, atol=0)
        b = bias.to(dtype)
        ext.int8_gemm(q, packed, row_scale, col_scale, b, out)
        ref = ref + b.double()
        bound = (ref.abs() + b.double().abs()) * (2 ** -21 if dtype == torch.float32 else 2 ** -8)
        assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 7, 13])
def test_int8_gemm_adds_the_outlier_product_as_dequantize_int32_does(ext, rows: int) -> None:
    """With extra_x [M, E] and extra_w [E, N] both int8 paths add extra_x @ extra_w into the scaled sums before the
    one rounding into the output, channel after channel, so they give the same bits (every row block, the last
    panel's masked columns, bf16 or fp32 weights, a block of columns of a wider weight for dequantize_int32)."""
    if not ext.int8_gemm_supported():
        pytest.skip("no int8_gemm in this build")
    cols, inputs, E = 100, 64, 3
    q, w = random_int8((rows, inputs), rows, ext.int8_gemm_input_max()), random_int8((cols, inputs), 7)
    gen = torch.Generator().manual_seed(1)
    row_scale, col_scale = torch.rand(rows, generator=gen) / 100, torch.rand(cols, generator=gen) / 100
    big, wide = torch.randn(rows, E, generator=gen) * 20, torch.randn(E, cols + 28, generator=gen)
    acc = torch.empty(rows, cols, dtype=torch.int32)
    ext.int8_gemm(q, Int8Weight.pack(w), None, None, None, acc)
    for dtype, w_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                           (torch.bfloat16, torch.float32)]:
        extra_w = wide[:, 28:].to(w_dtype)
        out, old = torch.empty(rows, cols, dtype=dtype), torch.empty(rows, cols, dtype=dtype)
        ext.int8_gemm(q, Int8Weight.pack(w), row_scale, col_scale, None, out, big, extra_w.contiguous())
        ext.dequantize_int32(acc, row_scale, col_scale, None, old, big, extra_w)
        assert torch.equal(out, old)
        ref = (acc.double() * row_scale.double()[:, None] * col_scale.double()
               + big.double() @ extra_w.double())
        torch.testing.assert_close(out.double(), ref, rtol=2 ** -20 if dtype == torch.float32 else 2 ** -8,
                                   atol=1e-5 * ref.abs().max().item())
    with pytest.raises(RuntimeError, match="go together"):
        ext.int8_gemm(q, Int8Weight.pack(w), row_scale, col_scale, None, out, big, None)
    with pytest.raises(RuntimeError, match="extra_w"):
        ext.int8_gemm(q, Int8Weight.pack(w), row_scale, col_scale, None, out, big, wide)
    with pytest.raises(RuntimeError, match="extra_x"):
        ext.dequantize_int32(acc, row_scale, col_scale, None, old, big.double(), wide[:, 28:])
    with pytest.raises(RuntimeError, match="no scales"):
        ext.int8_gemm(q, Int8Weight.pack(w), None, None, None, acc, big, wide[:, 28:].contiguous())


def test_the_outlier_rows_are_read_from_the_whole_weight_by_index(ext) -> None:
    """extra_rows [E]: channel j's weights are extra_w's row extra_rows[j] (Int8Weight passes its whole transposed
    weight, nothing gathered): the same bits as the gathered rows, on both int8 paths; a row it does not have is an
    error, not a read past it."""
    if not ext.int8_gemm_supported():
        pytest.skip("no int8_gemm in this build")
    rows, cols, inputs = 7, 100, 64
    q, w = random_int8((rows, inputs), 3, ext.int8_gemm_input_max()), random_int8((cols, inputs), 4)
    gen = torch.Generator().manual_seed(2)
    row_scale, col_scale = torch.rand(rows, generator=gen) / 100, torch.rand(cols, generator=gen) / 100
    big, whole = torch.randn(rows, 3, generator=gen) * 20, torch.randn(inputs, cols + 28, generator=gen)
    picked = torch.tensor([40, 3, 63])
    acc = torch.empty(rows, cols, dtype=torch.int32)
    ext.int8_gemm(q, Int8Weight.pack(w), None, None, None, acc)
    for w_dtype in (torch.float32, torch.bfloat16):
        wide = whole.to(w_dtype)[:, 28:]  # a block of columns: rows 128 apart
        gathered = wide.index_select(0, picked).contiguous()
        outs = [torch.empty(rows, cols, dtype=torch.bfloat16) for _ in range(4)]
        ext.int8_gemm(q, Int8Weight.pack(w), row_scale, col_scale, None, outs[0], big, gathered)
        ext.int8_gemm(q, Int8Weight.pack(w), row_scale, col_scale, None, outs[1], big, wide, picked)
        ext.dequantize_int32(acc, row_scale, col_scale, None, outs[2], big, gathered)
        ext.dequantize_int32(acc, row_scale, col_scale, None, outs[3], big, wide, picked)
        assert all(torch.equal(out, outs[0]) for out in outs[1:])
    for bad, match in [(torch.tensor([40, 3, 64]), "not a row"), (torch.tensor([40, -1, 3]), "not a row"),
                       (torch.tensor([40, 3]), "int64 \\[E\\]"), (picked.int(), "int64")]:
        with pytest.raises(RuntimeError, match=match):
            ext.int8_gemm(q, Int8Weight.pack(w), row_scale, col_scale, None, outs[0], big, wide, bad)
        with pytest.raises(RuntimeError, match=match):
            ext.dequantize_int32(acc, row_scale, col_scale, None, outs[0], big, wide, bad)
    with pytest.raises(RuntimeError, match="extra_w"):  # without extra_rows, extra_w has one row a channel
        ext.int8_gemm(q, Int8Weight.pack(w), row_scale, col_scale, None, outs[0], big, wide)
    with pytest.raises(RuntimeError, match="needs extra_x"):
        ext.int8_gemm(q, Int8Weight.pack(w), row_scale, col_scale, None, outs[0], None, None, picked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_outliers_int8_is_topk_index_fill_and_quantize_in_one_pass(ext, dtype: torch.dtype) -> None:
    """The E channels largest over the rows, largest first (amax(0).topk's), each row quantised with them zeroed,
    and their values in fp32: what Int8Weight.mm did with four torch ops and a gather, the same bits. Equal
    magnitudes: the lower channel first; a NaN counts as largest, and the other rows stay as they were."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, 64, generator=gen)
    x[:, [5, 17, 60]] *= torch.tensor([30.0, 10.0, 20.0])
    x = x.to(dtype)
    q, scale, channels, extra = ext.split_outliers_int8(x, 3, 100)
    assert channels.tolist() == [5, 60, 17] == x.abs().amax(0).float().topk(3).indices.tolist()
    ref_q, ref_scale = ext.quantize_rows_int8(x.index_fill(1, channels, 0), 100)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
    assert torch.equal(extra, x.index_select(1, channels).float())
    tied = torch.zeros(2, 8, dtype=dtype)
    tied[0, 6], tied[1, 2], tied[0, 4] = 3.0, -3.0, 1.0
    assert ext.split_outliers_int8(tied, 3)[2].tolist() == [2, 6, 4]
    x[4, 30] = float("nan")
    q, scale, channels, extra = ext.split_outliers_int8(x, 1, 127)
    assert channels.tolist() == [30] and extra[4, 0].isnan() and extra[:4].isfinite().all()
    rest = torch.cat([x[:4], x[5:]]).index_fill(1, channels, 0)
    assert torch.equal(torch.cat([q[:4], q[5:]]), ext.quantize_rows_int8(rest)[0])
    for E in (0, 65):
        with pytest.raises(RuntimeError, match="E must be"):
            ext.split_outliers_int8(x, E)


def test_int8_gemm_writes_a_block_of_columns(ext) -> None:
    """out may be a block of columns of a wider tensor: only that block is written."""
    if not ext.int8_gemm_supported():
        pytest.skip("no int8_gemm in this build")
    q, w = random_int8((5, 64), 1, ext.int8_gemm_input_max()), random_int8((100, 64), 2)
    wide = torch.full((5, 300), -1, dtype=torch.int32)
    ext.int8_gemm(q, Int8Weight.pack(w), None, None, None, wide[:, 100:200])
    assert torch.equal(wide[:, 100:200].long(), q.long() @ w.long().T)
    assert (wide[:, :100] == -1).all() and (wide[:, 200:] == -1).all()


def test_int8_gemm_bad_input_is_an_error_not_a_crash(ext) -> None:
    if not ext.int8_gemm_supported():
        pytest.skip("no int8_gemm in this build")
    q, packed = random_int8((3, 64), 1, ext.int8_gemm_input_max()), Int8Weight.pack(random_int8((100, 64), 2))
    scales = torch.ones(3), torch.ones(100)

    def run(q=q, packed=packed, scales=scales, bias=None, out=None):
        ext.int8_gemm(q, packed, *scales, bias, torch.empty(3, 100) if out is None else out)

    run()
    for kwargs, match in [
        ({"q": q.float()}, "int8"), ({"q": q.t()}, "contiguous"), ({"q": random_int8((3, 6), 1)}, "multiple of 4"),
        ({"q": random_int8((3, 32), 1)}, "K = 32"), ({"packed": packed.view(torch.int8)}, "uint8"),
        ({"packed": packed[:1]}, "columns"), ({"scales": (torch.ones(2), scales[1])}, "row_scale"),
        ({"scales": (scales[0], torch.ones(99))}, "col_scale"), ({"scales": (None, None)}, "row_scale"),
        ({"bias": torch.ones(100, dtype=torch.bfloat16)}, "bias"), ({"out": torch.empty(4, 100)}, "out"),
        ({"out": torch.empty(3, 100, dtype=torch.float16)}, "out"), ({"out": torch.empty(100, 3).t()}, "contiguous"),
        ({"out": torch.empty(3, 100, dtype=torch.int32)}, "no scales"),
        ({"out": torch.empty(100).expand(3, 100)}, "overlap"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            run(**kwargs)
    limit = ext.int8_gemm_input_max()  # AVX2's vpmaddubsw saturates past it: refused, not summed wrong
    assert limit == (127 if "avx512_vnni" in kernels._cpu_flags().split() else 64)
    if limit < 127:
        with pytest.raises(RuntimeError, match=f"within \\+-{limit}"):
            run(q=torch.full((3, 64), limit + 1, dtype=torch.int8))


@pytest.mark.parametrize("inputs", [64, 30])
def test_int8_weight_takes_any_shape(ext, inputs: int) -> None:
    """Int8Weight serves any [out, in]: the kernel for inputs in groups of 4 (any out: the last panel is padded),
    torch._int_mm otherwise (only where oneDNN's int8 products are exact)."""
    if inputs % 4 or not ext.int8_gemm_supported():
        skip_unless_int8_exact()
    w = torch.randn(70, inputs, generator=torch.Generator().manual_seed(3))
    weight = Int8Weight(w, ext)
    assert (weight.packed is not None) is (inputs % 4 == 0 and ext.int8_gemm_supported())
    assert torch.equal(weight.int8_rows(), (w * (1 / weight.scale[:, None])).round().to(torch.int8))
    x = torch.randn(9, inputs, generator=torch.Generator().manual_seed(4))
    xs = x.abs().amax(1, keepdim=True) / (ext.int8_gemm_input_max() if weight.packed is not None else 127)
    exact = ((x / xs).round().double() @ weight.int8_rows().double().T) * xs.double() * weight.scale.double()
    torch.testing.assert_close(weight.mm(x).double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_outlier_channels_go_through_the_plain_weight(ext, dtype: torch.dtype) -> None:
    """With outliers=k, the k input channels largest in the call are multiplied in full precision and the rest in
    int8 with a per-row scale that no longer has to hold them: exactly that sum, and far closer to the float product
    than plain w8a8 when a few channels run 20x the others (as in the model's hidden state)."""
    if not ext.int8_gemm_supported():
        skip_unless_int8_exact()
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(48, 64, generator=gen).to(dtype), torch.randn(7, 64, generator=gen)
    x[:, [3, 40]] *= 20
    x = x.to(dtype)
    split, plain = Int8Weight(w, ext, outliers=2), Int8Weight(w, ext)
    assert torch.equal(split.int8_rows(), plain.int8_rows())
    assert torch.equal(split.plain_t, w.t().contiguous())
    assert torch.equal(weight_forms.transposed(w, rows=5), w.t().contiguous())  # blocks that do not divide the rows
    rest = x.clone()
    rest[:, [3, 40]] = 0
    expected = plain.mm(rest).double() + x[:, [3, 40]].double() @ w[:, [3, 40]].double().T
    step = 1e-5 if dtype == torch.float32 else 2 ** -7
    out = split.mm(x)
    torch.testing.assert_close(out.double(), expected, rtol=step, atol=step * expected.abs().max().item())
    ref = x.double() @ w.double().T
    assert (out.double() - ref).norm() < 0.25 * (plain.mm(x).double() - ref).norm()
    assert split.mm(x[:0]).shape == (0, 48)


def test_linear_takes_int8_beyond_the_int4_rows(ext) -> None:
    """A PackedWeight with an int8 form answers with it for every batch the int4 kernel does not take."""
    other = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    weight = PackedWeight(other, None, Int8Weight(other * 2, ext))  # a different weight shows who answered
    x = torch.randn(INT4_MAX_ROWS + 1, 64, generator=torch.Generator().manual_seed(2))
    out, ref = linear(x, weight), x @ (other * 2).T
    assert ((out - ref).norm() / ref.norm()).item() < 0.03  # the int8 weight answered: the plain one is 2x off


@pytest.mark.parametrize("quant", [None, "Q4_1"])
def test_the_model_takes_the_loaders_weights_as_it_builds(tiny_model_dir, tmp_path, quant: str | None) -> None:
    """A built model holds no plain layer weight from the loader (only the forms it runs), and the loader's dicts
    are left empty: its plain weights and their packed copies are never all held at once (a model's peak at load
    ~1x its weights, not 2x). What it keeps (the embedding, norms) is in its own memory: a tensor of a mapped
    safetensors file would keep the whole file mapped, every page the build read resident."""
    import gc
    import shutil
    import weakref

    from pagedllm.model.llama import LlamaModel
    from pagedllm.model.loader import load_model

    if not PackedWeight.available(torch.float32):
        pytest.skip("no oneDNN here: the plain weights are what the model runs")
    folder = shutil.copytree(tiny_model_dir, tmp_path / "hf")  # a file no other test maps
    path = write_gguf(tiny_model_dir, str(tmp_path / "tiny.gguf"), quant=quant) if quant else str(folder)
    loaded = load_model(path, torch.float32, keep_4bit=True)
    assert bool(loaded.q4_weights) == bool(quant)
    names = [n for n in loaded.weights if n.endswith("_proj.weight")]
    assert bool(names) != bool(quant)  # a GGUF's 4-bit projections come as stored only: the build makes dense rows
    plain = [weakref.ref(loaded.weights[n]) for n in names]
    embed = loaded.weights["model.embed_tokens.weight"]
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, q4_weights=loaded.q4_weights)
    gc.collect()
    assert all(ref() is None for ref in plain)
    assert loaded.weights == {} and loaded.q4_weights == {}
    assert torch.equal(model.embed, embed) and model.embed.data_ptr() != embed.data_ptr()
    assert all(isinstance(w, PackedWeight) for ws in model.packed_weights().values() for w in ws)
    del embed
    gc.collect()
    assert not any(path in line for line in open("/proc/self/maps"))  # nothing holds the checkpoint's mapping
