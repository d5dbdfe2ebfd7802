"""The `pagedllm` command: generate, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.config import BATCHING_MODES, KV_POLICIES, QUANTIZATION_MODES, EngineConfig
from pagedllm.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM's."""
    d = EngineConfig.__dataclass_fields__
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=d["dtype"].default, choices=["auto", "bfloat16", "float32"])
    g.add_argument("--block-size", type=int, default=d["block_size"].default)
    g.add_argument("--kv-cache-memory", default=d["kv_cache_memory"].default,
                   help="KV cache size, e.g. 4GiB or 512MiB (a bare number is GiB)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    g.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"].default)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--quantization", default=d["quantization"].default, choices=QUANTIZATION_MODES,
                   help="auto: a GGUF file's 4-bit weights serve small batches as stored (bf16 only); "
                        "none: every weight dequantized")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "cpp", "reference"])
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d["enable_prefix_caching"].default, help="reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--seed", type=int, default=0, help="random seed (for generate: the request's own seed)")
    g.add_argument("--kv-policy", default=d["kv_policy"].default, choices=KV_POLICIES,
                   help="paged KV blocks, or a contiguous reservation per request as the paper's Orca baselines: "
                        "max model length, prompt + output rounded up to a power of two, or the exact length")
    g.add_argument("--batching", default=d["batching"].default, choices=BATCHING_MODES,
                   help="continuous (a request joins or leaves at any step) or static (a new batch only once the "
                        "last one has finished)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in EngineConfig.field_names()})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion to the terminal as its tokens come."""
    from pagedllm.engine import LLMEngine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)
    engine = LLMEngine(engine_config(args))
    tok = engine.tokenizer
    use_chat = tok.chat_template is not None and not args.raw
    if use_chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt: str | list[int] = tok.encode(text, add_special_tokens=False)
    else:
        prompt = args.prompt
    engine.add_request("cli", prompt, params)
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from pagedllm.bench import add_bench_commands

    add_bench_commands(bench, add_engine_args)

    from pagedllm.server import add_serve_command

    add_serve_command(sub, add_engine_args)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
