"""The 4-bit path: a GGUF file's Q4 weights run as stored. In bf16 (for batches of a few rows) it stays as close to
transformers on the dequantized weights as a bf16 run does; in fp32 its weights are bit for bit the loader's, so the
tokens are fp32's own."""

from __future__ import annotations

import pytest
import torch
from conftest import write_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.bench.hf_backend import load_hf_model
from pagedllm.model import kernels
from pagedllm.model.layers import INT4_MAX_ROWS, Int4Weight, PackedWeight
from pagedllm.model.loader.gguf import load_gguf

STEPS = 6


def int4_kernel_runs() -> bool:
    """The 4-bit kernel computes in bf16 with AVX512-BF16; a CPU without it (or a native bf16 matmul) has none."""
    ext = kernels.load()
    return PackedWeight.native(torch.bfloat16) and ext is not None and ext.int4_linear_supported()


def teacher_forced_logprobs(model, prompt: list[int], completion) -> torch.Tensor:
    """transformers' next-token logprobs [steps, vocab] at each token we generated, in one pass over our tokens."""
    ids = torch.tensor([prompt + list(completion.token_ids)])
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)


def logprob_error(completion, ref: torch.Tensor, other: torch.Tensor | None = None) -> float:
    """Largest |ours (or `other`'s) - ref| over the top-5 tokens we report at each step."""
    return max(abs((lp.logprob if other is None else float(other[i, token])) - float(ref[i, token]))
               for i, step in enumerate(completion.logprobs) for token, lp in step.items())


def assert_as_close_to_fp32_as_transformers_bf16(llm: LLM, gguf: str, prompts: list[list[int]]) -> None:
    """Over STEPS greedy tokens of each prompt alone, our top-5 logprobs stay as close to transformers' fp32 run of
    the file's dequantized weights as transformers' own bf16 run does (with a margin); every block comes back."""
    fp32, _, _ = load_hf_model(gguf, torch.float32)
    bf16, _, _ = load_hf_model(gguf, torch.bfloat16)
    ours_err = hf_err = 0.0
    for prompt in prompts:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5),
                           use_tqdm=False)[0].outputs[0]
        ref = teacher_forced_logprobs(fp32, prompt, out)
        ours_err = max(ours_err, logprob_error(out, ref))
        hf_err = max(hf_err, logprob_error(out, ref, teacher_forced_logprobs(bf16, prompt, out)))
    print(f"max top-5 logprob error vs fp32: ours {ours_err:.4f}, transformers bf16 {hf_err:.4f}")
    assert ours_err <= 1.5 * hf_err + 0.05, (ours_err, hf_err)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


@pytest.fixture(scope="module")
def q4_gguf(tiny_model_dir, tmp_path_factory) -> str:
    return write_gguf(tiny_model_dir, str(tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf"), quant="Q4_1")


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(dtype="bfloat16"), 2 * 4),  # qkv, o, gate_up, down in each of 2 layers
    (dict(dtype="bfloat16", quantization="none"), 0),
    (dict(dtype="float32"), 2 * 4),  # the fp32 kernel
    (dict(dtype="bfloat16", attention_backend="reference"), 0),
])
def test_which_engines_take_the_4bit_weights(q4_gguf, tiny_model_dir, kwargs, expected, monkeypatch):
    # The forms each engine loads: the measured dispatch may then drop the 4-bit one where another path wins every row
    # count (the tiny model's matmuls on AMD EPYC Zen 5), which tests/model/test_dispatch.py covers.
    monkeypatch.setenv("PAGEDLLM_KERNEL", "static")
    dtype = getattr(torch, kwargs["dtype"])
    if expected and not Int4Weight.kernel_available(dtype, kernels.load()):
        pytest.skip(f"no 4-bit kernel for {dtype} on this CPU")
    if expected and dtype == torch.bfloat16 and not int4_kernel_runs():
        pytest.skip("no native bf16 matmul on this CPU")
    assert LLM(model=q4_gguf, kv_cache_memory="16MiB", **kwargs).engine.runner.model.num_int4_matmuls == expected
    safetensors = LLM(model=tiny_model_dir, kv_cache_memory="16MiB", dtype="bfloat16")
    assert safetensors.engine.runner.model.num_int4_matmuls == 0


def test_single_stream_on_4bit_weights_stays_close_to_transformers(q4_gguf, monkeypatch):
    """One request at a time (every step has at most INT4_MAX_ROWS tokens, so every layer matmul is the int4 kernel):
    the logprobs stay as close to transformers' fp32 run of the dequantized weights as transformers' own bf16 run
    does, and every block comes back."""
    if not int4_kernel_runs():
        pytest.skip("no 4-bit kernel on this CPU (it needs AVX512-BF16)")
    calls = {"int4": 0}
    mm = Int4Weight.mm

    def counting_mm(self, x):
        calls["int4"] += 1
        return mm(self, x)

    monkeypatch.setattr(Int4Weight, "mm", counting_mm)
    monkeypatch.setenv("PAGEDLLM_KERNEL", "static")  # the hand-tuned routes: int4 up to INT4_MAX_ROWS, not measured
    llm = LLM(model=q4_gguf, dtype="bfloat16", kv_cache_memory="16MiB")
    prompts = [[1, 2000, 3000], [5, 6, 7, 8, 9, 10, 11, 12][:INT4_MAX_ROWS], [40000]]
    assert_as_close_to_fp32_as_transformers_bf16(llm, q4_gguf, prompts)
    assert calls["int4"] == 3 * STEPS * 2 * 4  # every step, every layer matmul


def count_calls(monkeypatch, method: str, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Int4Weight.<method> wrapped to count its calls (in "n"), checking the rows' dtype where one is given."""
    calls = {"n": 0}
    original = getattr(Int4Weight, method)

    def counting(self, x):
        assert dtype is None or x.dtype == dtype
        calls["n"] += 1
        return original(self, x)

    monkeypatch.setattr(Int4Weight, method, counting)
    return calls


def f32_kernel():
    ext = kernels.load()
    if not Int4Weight.kernel_available(torch.float32, ext):
        pytest.skip("no fp32 4-bit kernel on this CPU (it needs AVX-512F, or AVX2 and FMA)")
    return ext


def random_q4(rows: int, cols: int, q4_0: bool, seed: int) -> tuple[torch.Tensor, ...]:
    """4-bit values with fp16 scales (negative ones too, as Q4_0's quantizer makes) and mins (-8 scale for Q4_0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = ((torch.rand(rows, cols // 32, generator=g) - 0.3) * 0.02).half().float()
    min_ = -8 * scale if q4_0 else (-torch.rand(rows, cols // 32, generator=g) * 0.16).half().float()
    return q, scale, min_


@pytest.mark.parametrize("q4_0", [True, False])
@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 576), (128, 160), (576, 64)])
def test_fp32_int4_kernel_equals_float64(q4_0, n, k):
    """Every row count through both schedules (register rows up to 8, blocks of 6 beyond, an odd number of tiles run
    partly as halves): within fp32 summation error of float64 on the same weights, and each row alone as in the
    batch."""
    ext = f32_kernel()
    q, scale, min_ = random_q4(n, k, q4_0, n + k)
    w = (q.double().view(n, k // 32, 32) * scale.double()[..., None] + min_.double()[..., None]).view(n, k)
    weight = Int4Weight(q, scale, min_, ext, torch.float32)
    g = torch.Generator().manual_seed(3)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 17, 31, 32, 33, 63, 97, 131, 255, 299):
        x = torch.randn(rows, k, generator=g)
        out = weight.mm(x)
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        ref = x.double() @ w.T
        bound = 4 * k * 2 ** -24 * (x.double().abs() @ w.abs().T) + 1e-30  # fp32 sums of k products, loosely
        assert ((out.double() - ref).abs() <= bound).all(), rows
        for r in (0, rows - 1):
            assert torch.equal(weight.mm(x[r:r + 1].clone()), out[r:r + 1])


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1"])
def test_fp32_int4_weights_are_the_loaders_bit_for_bit(tiny_model_dir, tmp_path, quant):
    """The kernel's weights, read back through identity rows (each output then is one product 1 * w, exact), equal
    the fp32 weights the GGUF loader dequantizes (gguf.quants: (d * q) + m in fp32), through both schedules."""
    ext = f32_kernel()
    path = write_gguf(tiny_model_dir, str(tmp_path / f"tiny-{quant}.gguf"), quant=quant)
    loaded, dense = load_gguf(path, torch.float32, keep_4bit=True), load_gguf(path, torch.float32)
    assert len(loaded.q4_weights) == 2 * 7
    for i in range(2):  # as the model stacks them (k and v alone are not whole tiles of 64 rows)
        for group in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                      ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]):
            names = [f"model.layers.{i}.{n}.weight" for n in group]
            plain = torch.cat([dense.weights[n] for n in names])
            q4 = [loaded.q4_weights[n] for n in names]
            weight = Int4Weight(*(torch.cat([getattr(w, f) for w in q4]) for f in ("q", "scale", "min")), ext,
                                torch.float32)
            eye = torch.eye(plain.shape[1])
            assert torch.equal(weight.mm(eye), plain.T), names
            assert torch.equal(torch.cat([weight.mm(rows.contiguous()) for rows in eye.split(5)]), plain.T), names


def test_fp32_model_on_the_int4_kernel_gives_fp32_tokens(q4_gguf, monkeypatch):
    """An fp32 model with every layer matmul forced onto the fp32 4-bit kernel generates the same greedy tokens as
    forced onto oneDNN's fp32 matmul, and as transformers' fp32 run of the dequantized weights, for batches of one
    prompt and of several (prefill of many rows)."""
    f32_kernel()
    calls = {"int4": 0}
    mm = Int4Weight.mm

    def counting_mm(self, x):
        calls["int4"] += x.dtype == torch.float32
        return mm(self, x)

    monkeypatch.setattr(Int4Weight, "mm", counting_mm)
    prompts = [[1, 2000, 3000], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40000]]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    tokens = {}
    for path in ("int4", "onednn"):
        monkeypatch.setenv("PAGEDLLM_KERNEL", path)
        llm = LLM(model=q4_gguf, dtype="float32", kv_cache_memory="16MiB")
        tokens[path] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        if path == "int4":
            assert calls["int4"] >= STEPS * 2 * 4  # every step, every layer matmul
            calls_int4 = calls["int4"]
    assert calls["int4"] == calls_int4  # none on the oneDNN run
    assert tokens["int4"] == tokens["onednn"]
    hf, _, _ = load_hf_model(q4_gguf, torch.float32)
    for prompt, ours in zip(prompts, tokens["int4"], strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(STEPS):  # greedy, eos or not (ignore_eos)
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert ours == ids[len(prompt):]
