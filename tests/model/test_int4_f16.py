"""The 4-bit weights with fp16 products (csrc/int4_linear_f16.cpp, AVX512-FP16): closer to the fp32 product than
bf16's rounding, finite whatever the activations' scale, each row's sums its own, bf16 rows through the same sums, and
taken only where `--dtype auto` chose fp32 or the model is bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import write_gguf
from test_int4 import STEPS, assert_as_close_to_fp32_as_transformers_bf16, count_calls, random_q4

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.model import kernels
from pagedllm.model.layers import PackedWeight
from pagedllm.model.model_runner import fp16_products, fp16_tiles
from pagedllm.model.weight_forms import Int4Weight


def f16_kernel():
    ext = kernels.load()
    if not Int4Weight.f16_available(torch.float32, ext):
        pytest.skip("no fp16 4-bit kernel on this CPU (it needs AVX512-FP16)")
    return ext


def dequantized(q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.double().view(n, k // 32, 32) * scale.double()[..., None] + min_.double()[..., None]).view(n, k)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("q4_0", [True, False])
@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 576), (128, 160), (576, 1536)])
def test_fp16_products_are_closer_to_fp32_than_bf16s(q4_0, n, k):
    """Every block size (blocks of 6 rows and their remainders, an odd number of tiles run partly as halves, K not a
    multiple of the fp16 chunk): the error against float64 on the same weights is below that of rounding activations
    and weights to bf16, and each row alone gives the same bits as in the batch."""
    ext = f16_kernel()
    q, scale, min_ = random_q4(n, k, q4_0, n + k)
    w = dequantized(q, scale, min_)
    weight = Int4Weight(q, scale, min_, ext, torch.float32, f16=True)
    g = torch.Generator().manual_seed(5)
    for rows in (1, 2, 5, 6, 7, 13, 64, 131):
        x = torch.randn(rows, k, generator=g)
        x[:, 3] *= 40  # an outlier channel, as the hidden state has
        out = weight.mm_f16(x)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        ref = x.double() @ w.T
        bf16 = x.bfloat16().double() @ w.float().bfloat16().double().T
        assert relative_error(out, ref) < relative_error(bf16, ref), rows
        for r in (0, rows - 1):
            assert torch.equal(weight.mm_f16(x[r:r + 1].clone()), out[r:r + 1])


@pytest.mark.parametrize("magnitude", [1e-40, 1e-30, 1e-6, 1.0, 1e4, 1e30])
def test_any_activation_scale_stays_finite_and_close(magnitude):
    """Rows of any magnitude fp32 holds, down to its subnormals (and weights far from 1), come out finite and as close:
    each row is scaled by a power of two into fp16's range, the weights too, and both are divided out exactly."""
    ext = f16_kernel()
    q, scale, min_ = random_q4(128, 576, False, 1)
    scale, min_ = scale * 512, min_ * 512  # weights up to ~40: still fp16 values, scaled below 1 by the kernel
    w = dequantized(q, scale, min_)
    weight = Int4Weight(q, scale, min_, ext, torch.float32, f16=True)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2)) * magnitude
    out = weight.mm_f16(x)
    assert torch.isfinite(out).all()
    assert relative_error(out, x.double() @ w.T) < 3e-3


def test_a_row_of_zeros_or_nan_touches_no_other_row():
    ext = f16_kernel()
    q, scale, min_ = random_q4(64, 64, True, 3)
    weight = Int4Weight(q, scale, min_, ext, torch.float32, f16=True)
    x = torch.randn(4, 64)
    x[1] = 0
    x[2, 5] = float("nan")
    out = weight.mm_f16(x)
    assert torch.equal(out[1], torch.zeros(64))
    assert out[2].isnan().all()
    assert torch.equal(out[[0, 3]], weight.mm_f16(x[[0, 3]].clone()))


def test_the_weight_scale_is_the_power_of_two_below_the_largest_weight():
    q, scale, min_ = random_q4(64, 64, False, 4)
    s = Int4Weight.weight_scale(scale, min_)
    largest = float((15 * scale.abs() + min_.abs()).max())
    assert 0.5 <= largest * s < 1 and s == 2.0 ** round(torch.log2(torch.tensor(s)).item())
    assert Int4Weight.weight_scale(torch.zeros(2, 1), torch.zeros(2, 1)) == 1.0


@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 576), (128, 160)])
def test_bf16_rows_give_the_fp32_rows_sums_rounded_to_bf16(n, k):
    """A bf16 model's activations (exact in fp32) through the same fp16 sums: the output is the fp32 rows' output
    rounded to bf16 (nearest even), bit for bit, for every block size; a NaN row stays its own."""
    ext = f16_kernel()
    q, scale, min_ = random_q4(n, k, False, n * k)
    bf16 = Int4Weight(q, scale, min_, ext, torch.bfloat16, f16=True)
    fp32 = Int4Weight(q, scale, min_, ext, torch.float32, f16=True)
    g = torch.Generator().manual_seed(7)
    for rows in (1, 2, 5, 6, 7, 13, 64, 131):
        x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
        x[-1, 1] = float("nan") if rows > 1 else x[-1, 1]
        out = bf16.mm_f16(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        torch.testing.assert_close(out, fp32.mm_f16(x.float()).bfloat16(), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(out[0], bf16.mm_f16(x[:1].clone())[0])
        assert rows == 1 or (out[-1].isnan().all() and not out[:-1].isnan().any())


def test_a_bf16_weight_keeps_only_the_forms_its_route_takes():
    """A bf16 model's fp16 form is a second packing (the fp32 kernel's layout): the route's choice drops the other."""
    ext = f16_kernel()
    q, scale, min_ = random_q4(128, 64, True, 9)
    for taken in ({"int4_f16"}, {"int4"}, {"int4", "int4_f16"}):
        w = PackedWeight(torch.empty(128, 64, dtype=torch.bfloat16, device="meta"),
                         Int4Weight(q, scale, min_, ext, torch.bfloat16, f16=True), onednn=False)
        assert w.paths() == {"int4", "int4_f16"}
        w.keep_only(frozenset(taken))
        assert w.paths() == taken
        assert (w.int4.form is None) is ("int4" not in taken)
        assert (w.int4.f32_layout is None) is ("int4_f16" not in taken)
    assert not Int4Weight.f16_available(torch.bfloat16, ext, 96)  # not whole tiles of 64 outputs


def test_fp16_products_where_dtype_auto_chose_fp32_or_the_model_is_bf16(monkeypatch):
    """An explicit float32 stays exact; a bf16 model's 4-bit weights may take them (its own kernel rounds to bf16),
    its attention keeps its forms; quantization none or w8a8 keeps them out."""
    assert fp16_products(EngineConfig(dtype="auto"), torch.float32) and fp16_tiles(EngineConfig(), torch.float32)
    assert not fp16_products(EngineConfig(dtype="float32"), torch.float32)
    assert not fp16_tiles(EngineConfig(dtype="float32"), torch.float32)
    for dtype in ("auto", "bfloat16"):
        assert fp16_products(EngineConfig(dtype=dtype), torch.bfloat16)
        assert not fp16_tiles(EngineConfig(dtype=dtype), torch.bfloat16)
    for quantization in ("none", "w8a8", "int4"):
        for dtype in (torch.float32, torch.bfloat16):
            assert not fp16_products(EngineConfig(dtype="auto", quantization=quantization), dtype)


@pytest.fixture(scope="module")
def q4_gguf(tiny_model_dir, tmp_path_factory) -> str:
    return write_gguf(tiny_model_dir, str(tmp_path_factory.mktemp("q4f16") / "tiny-q4_1.gguf"), quant="Q4_1")


def test_a_model_forced_onto_fp16_products_runs_them_and_keeps_fp32s_tokens(q4_gguf, monkeypatch):
    """With `--dtype auto` choosing fp32, every layer matmul forced onto the fp16 form runs it, and greedy tokens
    equal the exact fp32 run's over a few steps of a few prompts (a batch of several: prefill rows too)."""
    f16_kernel()
    from pagedllm.model import bf16_choice
    monkeypatch.setattr(bf16_choice, "bf16_pays", lambda *a, **k: False)  # auto -> fp32, as on this kind
    calls = count_calls(monkeypatch, "mm_f16")
    prompts = [[1, 2000, 3000], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40000]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    monkeypatch.setenv("PAGEDLLM_KERNEL", "int4_f16")
    llm = LLM(model=q4_gguf, dtype="auto", quantization="auto", kv_cache_memory="16MiB")
    assert llm.engine.runner.model.f16
    f16 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls["n"] >= 6 * 2 * 4  # every step, every layer matmul
    monkeypatch.setenv("PAGEDLLM_KERNEL", "int4")
    exact = LLM(model=q4_gguf, dtype="float32", kv_cache_memory="16MiB")
    assert not exact.engine.runner.model.f16
    assert f16 == [list(o.outputs[0].token_ids) for o in exact.generate(prompts, params, use_tqdm=False)]


def test_a_bf16_model_on_fp16_products_stays_as_close_to_fp32_as_transformers_bf16(q4_gguf, monkeypatch):
    """Every layer matmul of a bf16 model forced onto the fp16 form runs it, and the logprobs stay as close to
    transformers' fp32 run of the dequantized weights as transformers' own bf16 run does; every block comes back."""
    f16_kernel()
    if not PackedWeight.native(torch.bfloat16):
        pytest.skip("no native bf16 matmul on this CPU")
    calls = count_calls(monkeypatch, "mm_f16", torch.bfloat16)
    monkeypatch.setenv("PAGEDLLM_KERNEL", "int4_f16")
    llm = LLM(model=q4_gguf, dtype="bfloat16", kv_cache_memory="16MiB")
    assert llm.engine.runner.model.f16
    prompts = [[1, 2000, 3000], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40000]]
    assert_as_close_to_fp32_as_transformers_bf16(llm, q4_gguf, prompts)
    assert calls["n"] == 3 * STEPS * 2 * 4  # every step, every layer matmul
