"""The 4-bit weights against int8 activations (csrc/int4_linear_q8.cpp, AVX512-VNNI or AVX2): the product of the weights
with each row's activations rounded to int8 per group of 32 (its 4 largest kept exact), each row's sums its own, bf16
rows through the same sums, taken only where `--dtype auto` chose fp32, and a model forced onto it staying as close to
fp32 as transformers' bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import write_gguf
from test_int4 import STEPS, assert_as_close_to_fp32_as_transformers_bf16, count_calls, random_q4
from test_int4_f16 import dequantized, relative_error

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.model import kernels
from pagedllm.model.layers import PackedWeight
from pagedllm.model.model_runner import int8_activations
from pagedllm.model.weight_forms import Int4Weight

KEPT = 4  # inputs each row keeps exact


def q8_kernel():
    ext = kernels.load()
    if not Int4Weight.q8_available(torch.float32, ext):
        pytest.skip("no int8-activation 4-bit kernel on this CPU (it needs AVX512-VNNI and AVX512-VBMI, or AVX2)")
    return ext


def fake_quantised(x: torch.Tensor, keep: int = KEPT) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `keep` largest |x| (exact) and the rest on the int8 grid of its group of 32, as the kernel rounds
    them: rint(x * (127 / amax)) * (amax / 127) in fp32."""
    rows, k = x.shape
    kept = torch.zeros_like(x)
    idx = x.abs().topk(keep, dim=1).indices
    kept.scatter_(1, idx, x.gather(1, idx))
    rest = (x - kept).view(rows, k // 32, 32)
    amax = rest.abs().amax(dim=2, keepdim=True)
    # 127 / amax divided, as the kernel does (torch's `127.0 / amax` is 127 * (1 / amax): one more rounding, which
    # moves a product lying within it of a half step to the other side)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    grid = torch.round(rest * inv) * (amax / 127.0)
    return grid.view(rows, k), kept


@pytest.mark.parametrize("q4_0", [True, False])
@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 576), (128, 160), (576, 1536)])
def test_the_product_of_the_weights_with_the_rows_on_the_int8_grid(q4_0, n, k):
    """Every block size (blocks of 6 rows and their remainders, an odd number of tiles run partly as halves): the
    output is float64's product of the file's weights with each row's activations on its int8 grid plus its kept
    inputs, to fp32's rounding; each row alone gives the same bits as in the batch."""
    ext = q8_kernel()
    q, scale, min_ = random_q4(n, k, q4_0, n + k)
    w = dequantized(q, scale, min_)
    weight = Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
    g = torch.Generator().manual_seed(5)
    for rows in (1, 2, 5, 6, 7, 13, 64, 131):
        x = torch.randn(rows, k, generator=g)
        x[:, 3] *= 40  # an outlier channel, as the hidden state has
        out = weight.mm_q8(x)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        grid, kept = fake_quantised(x)
        ref = (grid.double() + kept.double()) @ w.T
        assert relative_error(out, ref) < 1e-5, rows
        for r in (0, rows - 1):
            assert torch.equal(weight.mm_q8(x[r:r + 1].clone()), out[r:r + 1])


def test_the_kept_inputs_carry_a_rows_outliers():
    """With a channel 40x the others, int8 per group alone rounds its group's other inputs to a few steps: keeping
    each row's largest inputs exact more than halves the product's error."""
    ext = q8_kernel()
    q, scale, min_ = random_q4(192, 576, False, 11)
    w = dequantized(q, scale, min_)
    weight = Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(3))
    x[:, 3] *= 40
    x[:, 100:104] *= 20
    ref = x.double() @ w.T
    none_kept = fake_quantised(x, keep=0)[0].double() @ w.T
    assert relative_error(weight.mm_q8(x), ref) < 0.5 * relative_error(none_kept, ref)


@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 576), (128, 160)])
def test_bf16_rows_give_the_fp32_rows_sums_rounded_to_bf16(n, k):
    """bf16 activations (exact in fp32) through the same sums: the output is the fp32 rows' output rounded to bf16,
    bit for bit; a row with NaN gives NaN and touches no other row. (The engine runs it in fp32 models only; the
    kernel takes bf16 rows as its fp16 sibling does, for measuring it there: performance-log.md.)"""
    ext = q8_kernel()
    q, scale, min_ = random_q4(n, k, False, n * k)
    fp32 = Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
    g = torch.Generator().manual_seed(7)
    for rows in (1, 2, 5, 6, 7, 13, 64, 131):
        x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
        x[-1, 1] = float("nan") if rows > 1 else x[-1, 1]
        out = ext.int4_linear_q8(x, *fp32.f32_layout)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        torch.testing.assert_close(out, fp32.mm_q8(x.float()).bfloat16(), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(out[0], ext.int4_linear_q8(x[:1].clone(), *fp32.f32_layout)[0])
        assert rows == 1 or (out[-1].isnan().all() and not out[:-1].isnan().any())


def test_rows_of_zeros_inf_or_tiny_values():
    """A row of zeros gives zeros, one with inf NaN (and no other row changes); rows of tiny values, down to fp32's
    subnormals (where 127 / amax would overflow), as close to the exact product as ordinary ones."""
    ext = q8_kernel()
    q, scale, min_ = random_q4(64, 64, True, 3)
    w = dequantized(q, scale, min_)
    weight = Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4))
    x[1] = 0
    x[2, 5] = float("inf")
    x[4] *= 1e-40
    x[5] *= 1e-35
    x[6] *= 1e-25
    x[3] *= 1e-38  # but for its 4 largest inputs: groups of values past fp32's range for 127 / amax
    x[3, [3, 17, 40, 63]] = torch.tensor([1.0, -2.0, 0.5, 3.0])
    out = weight.mm_q8(x)
    assert torch.equal(out[1], torch.zeros(64))
    assert out[2].isnan().all()
    assert torch.isfinite(out[[0, 1, 3, 4, 5, 6]]).all()
    assert torch.equal(out[[0, 3]], weight.mm_q8(x[[0, 3]].clone()))
    ordinary = relative_error(out[0], x[0].double() @ w.T)
    for r in (3, 4, 5, 6):
        assert relative_error(out[r], x[r].double() @ w.T) < 2 * ordinary, r


def test_a_weight_keeps_only_the_forms_its_route_takes():
    """int4_q8 reads the fp32 kernel's nibbles: a route that takes only one of the two keeps them for it; a bf16
    model's weights have no int4_q8 form."""
    ext = q8_kernel()
    q, scale, min_ = random_q4(128, 64, True, 9)
    for taken in ({"int4_q8"}, {"int4"}, {"int4", "int4_q8"}):
        w = PackedWeight(torch.empty(128, 64, device="meta"),
                         Int4Weight(q, scale, min_, ext, torch.float32, q8=True), onednn=False)
        assert w.paths() == {"int4", "int4_q8"}
        w.keep_only(frozenset(taken))
        assert w.paths() == taken
        assert (w.int4.form is None) is ("int4" not in taken)
        assert (w.int4.f32_layout is None) is ("int4_q8" not in taken)
    assert not Int4Weight(q, scale, min_, ext, torch.bfloat16, q8=True).q8
    assert not Int4Weight.q8_available(torch.float32, ext, 96)  # not whole tiles of 64 outputs


@pytest.fixture(scope="module")
def q4_gguf(tiny_model_dir, tmp_path_factory) -> str:
    return write_gguf(tiny_model_dir, str(tmp_path_factory.mktemp("q4q8") / "tiny-q4_1.gguf"), quant="Q4_1")


def test_int8_activations_only_where_dtype_auto_chose_fp32():
    """An explicit float32 stays exact; in a bf16 model their error adds to bf16's own (1.11-1.39x plain bf16's at the
    gate: its edge), so not there; quantization none, int4 or w8a8 keeps them out."""
    assert int8_activations(EngineConfig(dtype="auto"), torch.float32)
    assert not int8_activations(EngineConfig(dtype="float32"), torch.float32)
    for dtype in ("auto", "bfloat16"):
        assert not int8_activations(EngineConfig(dtype=dtype), torch.bfloat16)
    for quantization in ("none", "w8a8", "int4"):
        assert not int8_activations(EngineConfig(dtype="auto", quantization=quantization), torch.float32)


def test_a_model_forced_onto_int8_activations_stays_as_close_to_fp32_as_transformers_bf16(q4_gguf, monkeypatch):
    """With `--dtype auto` choosing fp32, every layer matmul forced onto the int8-activation form runs it, and the
    logprobs stay as close to transformers' fp32 run of the dequantized weights as transformers' own bf16 run does;
    every block comes back. An explicit float32 and a bf16 model keep their own kernels."""
    q8_kernel()
    from pagedllm.model import bf16_choice
    monkeypatch.setattr(bf16_choice, "bf16_pays", lambda *a, **k: False)  # auto -> fp32
    calls = count_calls(monkeypatch, "mm_q8", torch.float32)
    monkeypatch.setenv("PAGEDLLM_KERNEL", "int4_q8")
    llm = LLM(model=q4_gguf, dtype="auto", kv_cache_memory="16MiB")
    assert llm.engine.runner.model.q8
    prompts = [[1, 2000, 3000], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40000]]
    assert_as_close_to_fp32_as_transformers_bf16(llm, q4_gguf, prompts)
    assert calls["n"] == 3 * STEPS * 2 * 4  # every step, every layer matmul
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        other = LLM(model=q4_gguf, dtype=dtype, kv_cache_memory="16MiB")
        assert not other.engine.runner.model.q8
        other.generate(prompts[:1], params, use_tqdm=False)
    assert calls["n"] == 3 * STEPS * 2 * 4
