"""bf16 on a CPU without native bf16 matmuls (AVX2, AVX-512 without BF16): each weight is packed widened to fp32 for
oneDNN (bf16 products are exact in fp32, so one rounding to bf16 at the end is bf16's matmul) beside torch's own bf16
matmul on the plain rows (`bf16_plain`), and the measured dispatch picks between them per row count. Such a CPU is
made here by patching PackedWeight.native, so this runs on every CPU kind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.model import dispatch, kernel_timing
from pagedllm.model.layers import BIGGEST, PackedWeight, linear


@pytest.fixture
def without_native_bf16(monkeypatch):
    monkeypatch.setattr(PackedWeight, "native", staticmethod(lambda dtype: dtype == torch.float32))


def bf16_case(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    return torch.randn(rows, 64, generator=g).bfloat16(), w, torch.randn(96, generator=g).bfloat16()


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_widened_weight_gives_bf16s_matmul(without_native_bf16, rows: int) -> None:
    x, w, b = bf16_case(rows)
    weight = PackedWeight(w)
    assert weight.widened and weight.paths() == frozenset({"onednn", "bf16_plain"})
    out = weight.mm(x, b, path="onednn")
    assert out.dtype == torch.bfloat16
    # fp32 sums over exact products, rounded once: a different summation order can move a rounding by one bf16 step
    exact = (x.double() @ w.double().T + b.double()).to(torch.bfloat16).float()
    assert torch.allclose(out.float(), exact, rtol=2 ** -7, atol=1e-6)
    assert (out.float() == exact).float().mean() > 0.9
    assert torch.equal(weight.mm(x, b, path="bf16_plain"), F.linear(x, w, b))


def test_routes_keep_only_the_forms_they_use(without_native_bf16) -> None:
    x, w, b = bf16_case(4)
    weight = PackedWeight(w)
    assert weight.route[-1][1] == "onednn"  # the static route: no hand-set cut-off for torch's bf16 matmul
    weight.route = ((2, "bf16_plain"), (BIGGEST, "onednn"))
    assert torch.equal(linear(x[:2], weight, b), F.linear(x[:2], w, b))
    weight.keep_only(frozenset({"onednn"}))
    assert weight.plain is None and weight.paths() == frozenset({"onednn"})


def test_torch_bf16_matmul_is_timed_only_at_small_batches(without_native_bf16) -> None:
    """Its calls at the biggest row counts took 0.1-1.4 s (a first start's whole budget) to lose by 6x: it is timed up
    to MAX_ROWS only, and the batches beyond go to oneDNN's matmul on the widened weight."""
    calls: list[tuple[str, int]] = []

    def timer(kind: str, path: str, rows: int, run) -> float:
        calls.append((path, rows))
        return {"bf16_plain": 1.0 + 4.0 * rows, "onednn": 6.0 + rows}[path] * 1e-6  # plain wins at 1 row only
    w = bf16_case(1)[1]
    weights = {"qkv": [PackedWeight(w) for _ in range(2)]}
    table = dispatch.measure(weights, torch.bfloat16, timer, budget_s=60)
    limit = kernel_timing.MAX_ROWS["bf16_plain"]
    assert max(rows for path, rows in calls if path == "bf16_plain") <= limit
    assert max(rows for path, rows in calls if path == "onednn") <= limit  # nothing left to compare beyond
    assert table.route("qkv") == ((1, "bf16_plain"), (BIGGEST, "onednn"))


def test_a_cpu_with_native_bf16_packs_bf16_as_it_is() -> None:
    weight = PackedWeight(bf16_case(1)[1])
    assert weight.widened is not PackedWeight.native(torch.bfloat16)
    assert (weight.plain is None) is PackedWeight.native(torch.bfloat16)


def test_the_engine_in_bf16_runs_on_widened_weights(tiny_model_dir, without_native_bf16) -> None:
    """The measured dispatch times both forms and routes each matmul; the tokens' logprobs stay near the torch
    reference path's in bf16 (no packing at all)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    llm = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_memory="16MiB", quantization="none")
    weights = llm.engine.runner.model.packed_weights()
    assert weights and all(w.widened for ws in weights.values() for w in ws)
    ours = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_memory="16MiB", attention_backend="reference")
    theirs = ref.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = b.outputs[0].token_ids[0]
        assert token in first_a and abs(first_a[token].logprob - first_b[token].logprob) < 0.1
