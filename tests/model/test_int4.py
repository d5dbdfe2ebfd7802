"""The 4-bit path: a GGUF file's Q4 weights run as stored for batches of a few rows (bf16 only), and stay as close to
transformers on the dequantized weights as a bf16 run does."""

from __future__ import annotations

import pytest
import torch
from conftest import write_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.bench.hf_backend import load_hf_model
from pagedllm.model import kernels
from pagedllm.model.layers import INT4_MAX_ROWS, Int4Weight, PackedWeight

STEPS = 6


def int4_kernel_runs() -> bool:
    """The 4-bit kernel computes in bf16 with AVX512-BF16; a CPU without it (or a native bf16 matmul) has none."""
    ext = kernels.load()
    return PackedWeight.available(torch.bfloat16) and ext is not None and ext.int4_linear_supported()


def teacher_forced_logprobs(model, prompt: list[int], completion) -> torch.Tensor:
    """transformers' next-token logprobs [steps, vocab] at each token we generated, in one pass over our tokens."""
    ids = torch.tensor([prompt + list(completion.token_ids)])
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)


def logprob_error(completion, ref: torch.Tensor, other: torch.Tensor | None = None) -> float:
    """Largest |ours (or `other`'s) - ref| over the top-5 tokens we report at each step."""
    return max(abs((lp.logprob if other is None else float(other[i, token])) - float(ref[i, token]))
               for i, step in enumerate(completion.logprobs) for token, lp in step.items())


@pytest.fixture(scope="module")
def q4_gguf(tiny_model_dir, tmp_path_factory) -> str:
    return write_gguf(tiny_model_dir, str(tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf"), quant="Q4_1")


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(dtype="bfloat16"), 2 * 4),  # qkv, o, gate_up, down in each of 2 layers
    (dict(dtype="bfloat16", quantization="none"), 0),
    (dict(dtype="float32"), 0),
    (dict(dtype="bfloat16", attention_backend="reference"), 0),
])
def test_which_engines_take_the_4bit_weights(q4_gguf, tiny_model_dir, kwargs, expected):
    if not int4_kernel_runs() and expected:
        pytest.skip("no 4-bit kernel on this CPU (it needs AVX512-BF16)")
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
    fp32, tok, _ = load_hf_model(q4_gguf, torch.float32)
    bf16, _, _ = load_hf_model(q4_gguf, torch.bfloat16)
    llm = LLM(model=q4_gguf, dtype="bfloat16", kv_cache_memory="16MiB")
    ours_err = hf_err = 0.0
    for prompt in ([1, 2000, 3000], [5, 6, 7, 8, 9, 10, 11, 12][:INT4_MAX_ROWS], [40000]):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5),
                           use_tqdm=False)[0].outputs[0]
        ref = teacher_forced_logprobs(fp32, prompt, out)
        ours_err = max(ours_err, logprob_error(out, ref))
        hf_err = max(hf_err, logprob_error(out, ref, teacher_forced_logprobs(bf16, prompt, out)))
    assert calls["int4"] == 3 * STEPS * 2 * 4  # every step, every layer matmul
    print(f"max top-5 logprob error vs fp32: ours {ours_err:.4f}, transformers bf16 {hf_err:.4f}")
    assert ours_err <= 1.5 * hf_err + 0.05, (ours_err, hf_err)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
