"""Which cheaper arithmetic could pass the accuracy gate, before writing its kernel: simulates ("fake-quantises")
int8 activations over the GGUF file's exact 4-bit weights, and 8-bit KV caches, on the gate's 32 held-out prompts
(`pagedllm bench accuracy`'s prompts, reference and error measure). Prints each variant's first-token agreement and
top-5 logprob error against fp32, and its ratio to plain bf16's (the gate: >= 95% and <= 1.25x).

    python docs/scripts/quant_gate_probe.py [NUM_PROMPTS]

The activation variants replace the big steps' layer matmuls (more than INT4_MAX_ROWS rows) by fp32 matmuls of the
quantised-dequantised activations with the exact 4-bit weights; the KV variants quantise and dequantise K/V before
they are written to the bf16 cache. Numerics match a real kernel's up to fp32/bf16 rounding; speed is not simulated.
"""

from __future__ import annotations

import sys

import torch

import pagedllm.model.llama as llama
from pagedllm.bench import accuracy
from pagedllm.entrypoints.llm import LLM
from pagedllm.model.layers import INT4_MAX_ROWS, Int4Weight, PackedWeight

MODE: dict[str, object] = {"act": None, "kv": None}


def exact_weight(w: Int4Weight) -> torch.Tensor:
    """The file's weights [out, in] in fp32, unpacked from the int4 kernel's layout (cached on the object)."""
    if not hasattr(w, "exact"):
        packed, scales, mins = w.form
        tiles, groups = packed.shape[:2]
        q = torch.stack([packed & 15, packed >> 4], 3).view(tiles, groups, 16, 16, 2)
        q = q.permute(0, 3, 1, 2, 4).reshape(tiles * 16, groups, 32).float()
        scale, mn = (a.transpose(1, 2).reshape(tiles * 16, groups, 1).float() for a in (scales, mins))
        w.exact = (q * scale + mn).reshape(tiles * 16, groups * 32)
    return w.exact


def fake_int8(x: torch.Tensor, group: int, symmetric: bool = True) -> torch.Tensor:
    """x quantised to 8 bits per group of `group` along its last dim (0: the whole row) and back, in fp32."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], -1, group or shape[-1])
    if symmetric:
        s = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return ((g / s).round().clamp(-127, 127) * s).reshape(shape)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo).clamp_min(1e-12) / 255
    return (((g - lo) / s).round().clamp(0, 255) * s + lo).reshape(shape)


_linear, _write_kv = llama.linear, llama.write_kv


def linear(x, weight, bias=None):
    act = MODE["act"]
    if act is not None and isinstance(weight, PackedWeight) and weight.int4 is not None and x.shape[0] > INT4_MAX_ROWS:
        out = (fake_int8(x, act) @ exact_weight(weight.int4).t()).to(x.dtype)
        return out if bias is None else out.add_(bias)
    return _linear(x, weight, bias)


def write_kv(k, v, k_cache, v_cache, slot_mapping, ext=None):
    kv = MODE["kv"]
    if kv is not None and k_cache.dtype == torch.bfloat16:
        if kv == "fp8":
            k, v = (t.float().to(torch.float8_e4m3fn).float() for t in (k, v))
        else:
            group, symmetric = kv
            k, v = fake_int8(k, group, symmetric), fake_int8(v, group, symmetric)
    return _write_kv(k, v, k_cache, v_cache, slot_mapping, ext)


VARIANTS = [  # name, --quantization, activation group (0: per token), KV: (group, symmetric) or "fp8"
    ("bf16", "none", None, None),
    ("default (auto)", "auto", None, None),
    ("int8 act. per token", "auto", 0, None),
    ("int8 act. per 64", "auto", 64, None),
    ("int8 act. per 32", "auto", 32, None),
    ("KV fp8 e4m3", "auto", None, "fp8"),
    ("KV int8 sym. per 64", "auto", None, (64, True)),
    ("KV int8 asym. per 64", "auto", None, (64, False)),
    ("KV int8 asym. per 32", "auto", None, (32, False)),
    ("KV int8 asym. per 16", "auto", None, (16, False)),
]


def main() -> None:
    num = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    llama.linear, llama.write_kv = linear, write_kv
    reference_llm = LLM(None, dtype="float32", threads=2)
    prompts = accuracy.held_out_prompts(reference_llm.get_tokenizer(), num, 1234)
    reference = accuracy.first_steps(reference_llm, prompts)
    del reference_llm
    base = None
    print(f"{'variant':<24} {'first token':>11} {'top-5 lp err':>12} {'vs bf16':>8}")
    for name, quantization, act, kv in VARIANTS:
        MODE["act"], MODE["kv"] = act, kv
        llm = LLM(None, dtype="bfloat16", quantization=quantization, threads=2)
        r = accuracy.compare(reference, accuracy.first_steps(llm, prompts))
        base = base or r.mean_top5_logprob_error
        print(f"{name:<24} {r.first_token_agreement:>11.1%} {r.mean_top5_logprob_error:>12.4f} "
              f"{r.mean_top5_logprob_error / base:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
