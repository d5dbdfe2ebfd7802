"""A `pagedllm serve` launched as a subprocess for a benchmark or a test: a free port, ready once /health answers,
stopped on leaving; the model card it serves; and the engine flags of a benchmark's command line passed on to it.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from pagedllm.bench.client import error_message
from pagedllm.config import EngineConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagedllm serve ARGV` as a subprocess on `port` (default: a free local one), ready (/health) for as long as the
    `with` lasts."""

    def __init__(self, argv: Sequence[str], log_path: str, timeout: float = 600.0,
                 env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.argv, self.log_path, self.timeout, self.env = list(argv), log_path, timeout, env
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(self.port), *self.argv]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        raise RuntimeError(f"the server was not ready after {self.timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]


def fetch_model_card(base_url: str, api_key: str | None = None) -> dict[str, Any]:
    """The first model the server lists (its id, and max_model_len / root where the server says them)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {base_url}: {e}") from None
    if response.status_code != 200:
        raise ValueError(f"{base_url}/v1/models: HTTP {response.status_code}: {error_message(response.content)}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]


def engine_actions() -> list[argparse.Action]:
    """The engine flags' argparse actions, from a throwaway parser (argparse has no public list of them)."""
    probe = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_cli_args(probe)
    return list(probe._actions)


def passthrough_argv(args: argparse.Namespace, actions: Sequence[argparse.Action]) -> list[str]:
    """The engine flags set on this command line (not at their defaults) as argv for `pagedllm serve`;
    --kv-policy is left out, the sweep sets it per launch."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest == "kv_policy" or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0] if value else action.option_strings[1])
        elif action.nargs == 0:
            argv.append(action.option_strings[0])
        elif isinstance(value, list):
            argv += [action.option_strings[0], *map(str, value)]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv
