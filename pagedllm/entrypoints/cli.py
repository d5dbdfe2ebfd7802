"""The `pagedllm` command: generate, bench, serve, replay."""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

from pagedllm.config import EngineConfig
from pagedllm.frozen_imports import frozen_imports


class DefaultsFormatter(argparse.HelpFormatter):
    """Each option's default after its help, as argparse.ArgumentDefaultsHelpFormatter writes it, also for options
    without help text, but not for flags (False) or options without one (None)."""

    def _format_action(self, action: argparse.Action) -> str:
        help_text, default = action.help or "", action.default
        shows = action.option_strings and help_text is not argparse.SUPPRESS and "%(default)" not in help_text
        if shows and action.nargs != 0 and not any(default is v for v in (None, False, argparse.SUPPRESS)):
            action = copy.copy(action)
            action.help = f"{action.help or ''} (default: %(default)s)".strip()
        return super()._format_action(action)


class CommandParser(argparse.ArgumentParser):
    """A parser whose arguments are added when its command is used, so `pagedllm --help` imports no command's modules
    (torch, fastapi, the engine: 5-8 s); a mistyped option or command gets the closest one suggested."""

    def __init__(self, *args: object, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._add_arguments = add_arguments
        self.used = False

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 (argparse's signature)
        self.used = True
        if self._add_arguments is not None:
            add, self._add_arguments = self._add_arguments, None
            add(self)
        return super().parse_known_args(args, namespace)

    def used_chain(self) -> list[CommandParser]:
        """This parser and the subcommands' parsers this command line went into."""
        chain: list[CommandParser] = [self]
        while True:
            subs = [a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)]
            used = [p for a in subs for p in a.choices.values() if getattr(p, "used", False)]
            if not used:
                return chain
            chain.append(used[0])

    def error(self, message: str) -> NoReturn:
        chain = self.used_chain()
        hint = suggestion(message, chain)
        chain[-1].print_usage(sys.stderr)
        chain[-1].exit(2, f"{chain[-1].prog}: error: {message}{hint}\n")


def suggestion(message: str, chain: list[CommandParser]) -> str:
    """"; did you mean --max-tokens?" for an unknown option or an invalid choice close to a known one."""
    unknown = re.match(r"unrecognized arguments: (\S+)", message)
    if unknown:
        word = unknown.group(1).split("=")[0]
        known = [s for p in chain for a in p._actions for s in a.option_strings if s.startswith("--")]
    else:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if not choice:
            return ""
        word, known = choice.group(1), re.findall(r"'([^']*)'", choice.group(2))
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1: all tokens")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    add_sampling_args(gen)
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion to the terminal as its tokens come."""
    with frozen_imports():  # torch's and the engine's objects: out of the collector's way
        from pagedllm.engine.llm_engine import LLMEngine
        from pagedllm.sampling_params import SamplingParams

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


def add_bench_args(bench: argparse.ArgumentParser) -> None:
    from pagedllm.bench.commands import add_bench_commands  # the one place outside bench/ that imports it

    add_bench_commands(bench.add_subparsers(dest="bench", required=True))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.serve import add_serve_args as add

    add(p)


def add_replay_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.replay import add_replay_args as add

    add(p)


COMMANDS = {  # name -> (help, what adds its arguments): each command's modules are imported only when it runs
    "generate": ("generate a completion for one prompt, streamed to the terminal", add_generate_args),
    "bench": ("benchmarks", add_bench_args),
    "serve": ("OpenAI-compatible HTTP server", add_serve_args),
    "replay": ("serve the KV cache dashboard over a trace of `bench throughput --trace`", add_replay_args),
}


def build_parser() -> CommandParser:
    parser = CommandParser(prog="pagedllm", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, (help_text, add_arguments) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_arguments=add_arguments)
    return parser


def main(argv: list[str] | None = None) -> int:
    with quiet_interrupt():
        try:
            args = build_parser().parse_args(argv)
            logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            return args.func(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2


def exit_on_interrupt(signum: int, frame: object) -> None:
    """Ctrl-C: stop at once and quietly, ended by SIGINT itself (a shell shows 130), as Python ends on an uncaught
    KeyboardInterrupt but without its traceback. A KeyboardInterrupt is not enough: while a model loads it can be
    raised inside a C++ callback, which aborts the process (std::terminate, a core dump)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write("\n")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def quiet_interrupt() -> Iterator[None]:
    """exit_on_interrupt while a command runs (uvicorn puts its own graceful handler in place while it serves, and
    hands a Ctrl-C back after); an ignored SIGINT (a background job) stays ignored, the caller's handler comes back."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGINT, exit_on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
