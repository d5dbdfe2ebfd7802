"""The `pagedllm` command: generate, bench, serve, replay."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.replay import add_replay_command
from pagedllm.entrypoints.serve import add_serve_command
from pagedllm.sampling_params import SamplingParams


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
    from pagedllm.engine.llm_engine import LLMEngine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)
    engine = LLMEngine(EngineConfig.from_cli_args(args))
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
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from pagedllm.bench.commands import add_bench_commands  # the one place outside bench/ that imports it

    add_bench_commands(bench)
    add_serve_command(sub)
    add_replay_command(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
