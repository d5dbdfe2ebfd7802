"""The int8 outlier-channel split (Int8Weight's `outliers`) against the accuracy gate, on the gate's held-out prompts
(seed 1234, all queued at once, one greedy token with logprobs; fp32 the reference, plain bf16 the yardstick):

1. where the int8 lm_head's error comes from, over the final hidden states of those prompts: activations or weights
   quantised alone, both, and both with the k largest input channels taken out (no top-candidate rescoring here);
2. the default path (int8 lm_head) with 0, 8, 16, 32 outlier channels: its error / bf16's, as the gate computes it;
3. --quantization w8a8 (every layer matmul in int8) with the split on the layers too, all kinds and one at a time.

    python docs/scripts/outlier_channels_gate.py [--num-prompts 24] [--skip-layers]
"""

from __future__ import annotations

import argparse

import torch

from pagedllm.bench.accuracy import compare, first_steps, held_out_prompts
from pagedllm.entrypoints.llm import LLM
from pagedllm.model import layers, llama, model_runner

KINDS = ("qkv", "o", "gate_up", "down")


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded through int8 with one scale per row, back in fp32."""
    scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def top5_error(logits: torch.Tensor, exact: torch.Tensor) -> float:
    ref = exact.log_softmax(-1)
    top = ref.topk(5, dim=-1).indices
    return (logits.log_softmax(-1).gather(1, top) - ref.gather(1, top)).abs().mean().item()


def error_sources(prompts: list[list[int]]) -> None:
    hidden: list[torch.Tensor] = []
    original = llama.LlamaModel.compute_logits

    def keep_hidden(self, h: torch.Tensor) -> torch.Tensor:
        hidden.append(h.float().clone())
        return original(self, h)

    llama.LlamaModel.compute_logits = keep_hidden
    try:
        llm = LLM(None, dtype="bfloat16", quantization="none", kv_cache_memory="256MiB")
        first_steps(llm, prompts)
    finally:
        llama.LlamaModel.compute_logits = original
    w = llm.engine.runner.model.lm_head.float()
    h = torch.cat(hidden)
    exact = h @ w.T
    amax = h.abs().amax(0)
    print(f"final hidden state, per channel max |x|: top {amax.topk(4).values.tolist()}, median {amax.median():.2f}")
    print(f"lm_head top-5 logprob error vs the fp32 product of bf16 values ({len(h)} rows):")
    print(f"  int8 weights only      {top5_error(h @ quantize_rows(w).T, exact):.4f}")
    print(f"  int8 activations only  {top5_error(quantize_rows(h) @ w.T, exact):.4f}")
    print(f"  both                   {top5_error(quantize_rows(h) @ quantize_rows(w).T, exact):.4f}")
    for k in (4, 8, 16):
        channels = amax.topk(k).indices
        rest = h.index_fill(1, channels, 0)
        split = quantize_rows(rest) @ quantize_rows(w).T + h[:, channels] @ w[:, channels].T
        print(f"  both, {k:2d} channels split  {top5_error(split, exact):.4f}")


def gate_ratio(reference: list, prompts: list[list[int]], base: float, **kwargs: object) -> str:
    out = compare(reference, first_steps(LLM(None, dtype="bfloat16", kv_cache_memory="256MiB", **kwargs), prompts))
    return f"first token {out.first_token_agreement:.1%}, error {out.mean_top5_logprob_error:.4f} = " \
           f"{out.mean_top5_logprob_error / base:.3f}x bf16"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--skip-layers", action="store_true", help="only parts 1 and 2")
    args = ap.parse_args()
    reference_llm = LLM(None, dtype="float32", kv_cache_memory="256MiB")
    prompts = held_out_prompts(reference_llm.get_tokenizer(), args.num_prompts, 1234)
    reference = first_steps(reference_llm, prompts)
    del reference_llm
    error_sources(prompts)
    base = compare(reference, first_steps(LLM(None, dtype="bfloat16", quantization="none",
                                              kv_cache_memory="256MiB"), prompts)).mean_top5_logprob_error
    print(f"plain bf16: top-5 logprob error {base:.4f}")
    default_outliers = llama.LM_HEAD_OUTLIER_CHANNELS
    for k in (0, 8, 16, 32):
        llama.LM_HEAD_OUTLIER_CHANNELS = k
        print(f"default path, lm_head with {k:2d} outlier channels: {gate_ratio(reference, prompts, base)}")
    llama.LM_HEAD_OUTLIER_CHANNELS = default_outliers
    if args.skip_layers:
        return
    original_init = layers.Int8Weight.__init__
    for kinds, k in [(KINDS, 0), (KINDS, 16), (KINDS, 32), (KINDS, 64), *(((kind,), 32) for kind in KINDS)]:
        def init(self, plain, ext, kernel=True, outliers=0, k=k):  # the layers get k; the lm_head keeps its own
            original_init(self, plain, ext, kernel, outliers or k)
        layers.Int8Weight.__init__ = init
        model_runner.INT8_MATMULS = (*kinds, "lm_head")
        try:
            print(f"w8a8 on {'+'.join(kinds)}, {k} outlier channels: "
                  f"{gate_ratio(reference, prompts, base, quantization='w8a8')}")
        finally:
            layers.Int8Weight.__init__ = original_init


if __name__ == "__main__":
    main()
