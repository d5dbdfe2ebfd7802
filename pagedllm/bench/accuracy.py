"""`pagedllm bench accuracy`: the accuracy gate for cheaper arithmetic. On held-out prompts, each variant's greedy
first token against the fp32 reference's, and its mean error on the reference's top-5 next-token logprobs, beside
plain bf16 on the same dequantised weights. The default path may use a quantised variant only if it agrees with
fp32 on >= 95% of first tokens and its mean top-5 logprob error is at most 1.25x plain bf16's."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from unittest import mock

from pagedllm.bench.datasets import sample_requests
from pagedllm.bench.results import write_json
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

TOP = 5  # the reference's top tokens whose logprobs are compared
WIDE = 20  # logprobs each variant reports, so the reference's top 5 are almost always among them
GATE_AGREEMENT = 0.95
GATE_ERROR_RATIO = 1.25
DEFAULT_VARIANTS = {"bf16": dict(dtype="bfloat16", quantization="none"),
                    "bf16 + int4 small steps": dict(dtype="bfloat16", quantization="int4"),
                    "bf16 default": dict(dtype="bfloat16", quantization="auto"),
                    "bf16 default + int8 KV": dict(dtype="bfloat16", quantization="auto", kv_cache_dtype="int8"),
                    # an explicit float32 over a bf16 KV cache: fp32's own matmuls
                    "fp32 + bf16 KV cache": dict(dtype="float32", quantization="auto", kv_cache_dtype="bfloat16"),
                    # the defaults as `--dtype auto` chooses here: bf16 where it pays, else fp32 arithmetic over a
                    # bf16 cache with the int8 lm_head and, measured faster, the 4-bit weights' fp16 products
                    # (AVX512-FP16) or against int8 activations (AVX512-VNNI)
                    "defaults (dtype auto)": dict(dtype="auto", quantization="auto")}


@dataclass
class Agreement:
    first_token_agreement: float
    mean_top5_logprob_error: float
    max_top5_logprob_error: float


def held_out_prompts(tokenizer, num: int, seed: int) -> list[list[int]]:
    """ShareGPT-like prompts from a seed used nowhere else: the gate is not tuned on them."""
    return [r.prompt_token_ids for r in sample_requests("sharegpt", tokenizer, num, seed)]


def first_steps(llm, prompts: Sequence[list[int]]) -> list[RequestOutput]:
    """Every prompt queued at once (their prefill runs in large steps), one greedy token with logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=WIDE)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def compare(reference: list[RequestOutput], variant: list[RequestOutput]) -> Agreement:
    """First-token agreement, and |variant - reference| logprob over the reference's top 5 (a token missing from the
    variant's top 20 counts at the variant's 20th logprob, an underestimate of its error)."""
    agree, errors = 0, []
    for ref, var in zip(reference, variant):
        ref_c, var_c = ref.outputs[0], var.outputs[0]
        agree += ref_c.token_ids[0] == var_c.token_ids[0]
        ref_lp, var_lp = ref_c.logprobs[0], var_c.logprobs[0]
        floor = min(lp.logprob for lp in var_lp.values())
        top = sorted(ref_lp.items(), key=lambda kv: -kv[1].logprob)[:TOP]
        errors += [abs(var_lp[t].logprob - lp.logprob if t in var_lp else floor - lp.logprob) for t, lp in top]
    return Agreement(agree / len(reference), statistics.fmean(errors), max(errors))


def run_gate(model: str | None, num_prompts: int, seed: int, variants: dict[str, dict] | None = None,
             **engine_args: object) -> dict:
    """The fp32 reference and each variant on the same prompts; the gate's verdict for each variant. A variant's
    "environment" entry holds environment variables for its build (PAGEDLLM_KERNEL=int8: every matmul on its int8 form,
    not only where the measured dispatch found it faster)."""
    from pagedllm.entrypoints.llm import LLM

    reference_llm = LLM(model, dtype="float32", **engine_args)
    prompts = held_out_prompts(reference_llm.get_tokenizer(), num_prompts, seed)
    reference = first_steps(reference_llm, prompts)
    del reference_llm
    rows = {}
    for name, kwargs in (variants or DEFAULT_VARIANTS).items():
        kwargs = dict(kwargs)
        with mock.patch.dict(os.environ, kwargs.pop("environment", {})):  # restored after the build
            llm = LLM(model, **kwargs, **engine_args)
        rows[name] = compare(reference, first_steps(llm, prompts)).__dict__
        del llm
    base = rows.get("bf16", {}).get("mean_top5_logprob_error")
    for row in rows.values():
        row["error_vs_bf16"] = round(row["mean_top5_logprob_error"] / base, 3) if base else None
        row["passes"] = bool(row["first_token_agreement"] >= GATE_AGREEMENT
                             and (row["error_vs_bf16"] is None or row["error_vs_bf16"] <= GATE_ERROR_RATIO))
    return {"model": model or "SmolLM2-135M-Instruct (default)", "num_prompts": len(prompts), "seed": seed,
            "mean_prompt_tokens": round(statistics.fmean(map(len, prompts)), 1), "variants": rows,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus"}


def cmd_accuracy(args: argparse.Namespace) -> int:
    result = run_gate(args.model, args.num_prompts, args.seed, threads=args.threads)
    print(f"{result['num_prompts']} held-out prompts (seed {result['seed']}, mean {result['mean_prompt_tokens']} "
          f"tokens), against the fp32 reference:")
    print(f"{'variant':<26} {'first token':>11} {'top-5 lp err mean':>17} {'max':>6} {'vs bf16':>7} {'gate':>5}")
    for name, r in result["variants"].items():
        verdict = "pass" if r["passes"] else "FAIL"
        print(f"{name:<26} {r['first_token_agreement']:>11.1%} {r['mean_top5_logprob_error']:>17.4f} "
              f"{r['max_top5_logprob_error']:>6.3f} {r['error_vs_bf16'] or 0:>6.2f}x {verdict:>5}")
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    ac = sub.add_parser("accuracy", help="the accuracy gate: quantised paths vs the fp32 reference vs plain bf16",
                        description="Each variant's engine measures its kernel and attention routes as a server "
                        "would, and which of the equally valid forms a step takes moves a variant's error by ~10-15% "
                        "on a few dozen prompts: ratios move that much between runs. PAGEDLLM_KERNEL=static "
                        "PAGEDLLM_ATTENTION=static in the environment pins every variant to the hand-set routes "
                        "(the same numbers every run).")
    ac.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    ac.add_argument("--num-prompts", type=int, default=32)
    ac.add_argument("--seed", type=int, default=1234, help="of the held-out prompts")
    ac.add_argument("--threads", type=int, default=None)
    ac.add_argument("--output-json", default=None)
    ac.set_defaults(func=cmd_accuracy)
