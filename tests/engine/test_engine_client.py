"""The engine-client protocol (engine/protocol.py) and the server's settings (ServerConfig): what both engine
clients implement, the admission check they share, and the serve flags' one set of defaults."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from pagedllm.config import ServerConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.protocol import EngineClient, EngineDeadError, QueueFullError, TooManySequencesError
from pagedllm.engine.replica_pool import PoolConfig, PoolStream, ReplicaPool
from pagedllm.entrypoints.serve import add_serve_command
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

# what each client must write itself (the protocol's own bodies are stubs); check_admission and generate are shared
OWN = ["start", "shutdown", "is_alive", "num_waiting", "num_waiting_seqs", "check_alive", "replica_health",
       "tokenize_prompt",
       "compile_grammar", "add_request", "abort"]


@pytest.mark.parametrize("client", [AsyncLLMEngine, ReplicaPool])
def test_both_clients_implement_the_protocol_and_share_admission(client: type) -> None:
    assert EngineClient in client.__mro__
    assert [name for name in OWN if name not in vars(client)] == []
    assert client.check_admission is EngineClient.check_admission
    assert client.generate is EngineClient.generate


class Client(EngineClient):
    def __init__(self, alive: bool, waiting: int) -> None:
        self.alive, self.waiting, self.max_waiting_requests = alive, waiting, 2

    @property
    def num_waiting(self) -> int:
        return self.waiting

    @property
    def num_waiting_seqs(self) -> int:
        return self.waiting

    def check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError("down")


def test_admission_refuses_a_dead_engine_then_a_full_queue() -> None:
    Client(True, 1).check_admission()
    with pytest.raises(QueueFullError, match="2 sequences are already waiting and this request adds 1"):
        Client(True, 2).check_admission()
    with pytest.raises(QueueFullError, match="1 sequences are already waiting and this request adds 2"):
        Client(True, 1).check_admission(2)
    with pytest.raises(TooManySequencesError, match="asks for 3 sequences"):
        Client(True, 0).check_admission(3)
    with pytest.raises(EngineDeadError, match="down"):
        Client(False, 0).check_admission()


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_flags_default_to_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    assert ServerConfig.from_cli_args(serve_args()) == ServerConfig()
    assert PoolConfig(1).max_waiting_requests == ServerConfig().max_waiting_requests == 256
    config = ServerConfig.from_cli_args(serve_args("--max-waiting-requests", "8", "--no-dashboard"))
    assert config.max_waiting_requests == 8 and config.dashboard is None
    monkeypatch.setenv("PAGEDLLM_API_KEY", "secret")
    assert ServerConfig.from_cli_args(serve_args()).api_key == "secret"
    assert ServerConfig.from_cli_args(serve_args("--api-key", "flag")).api_key == "flag"


@pytest.mark.parametrize("flag", ["max_waiting_requests", "max_request_bytes", "body_timeout", "stream_send_timeout",
                                  "timeout_keep_alive", "responses_store_size", "responses_store_ttl"])
def test_server_config_refuses_limits_that_are_not_positive(flag: str) -> None:
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be positive, got 0"):
        ServerConfig(**{flag: 0})


def test_a_streamed_request_moves_until_its_reader_has_sent_something() -> None:
    """A replica's outputs whose text the detokenizer still holds back (empty) send nothing to a streaming client, so
    the request may still start over elsewhere if the replica dies; once text (or, with logprobs, any token) has
    come, it may not."""
    def output(text: str) -> RequestOutput:
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [7], None, None)], finished=False)

    pool = ReplicaPool.__new__(ReplicaPool)  # _deliver needs no Ray for a running request's output
    for params, movable_after_empty in ((SamplingParams(max_tokens=8), True),
                                        (SamplingParams(max_tokens=8, logprobs=1), False)):
        stream = PoolStream(pool, "r", [1, 2], params)
        replica = SimpleNamespace(requests={"r": stream})
        ReplicaPool._deliver(pool, replica, "r", output(""))
        assert stream.movable is movable_after_empty
        ReplicaPool._deliver(pool, replica, "r", output("Once"))
        ReplicaPool._deliver(pool, replica, "r", output("Once"))  # no new text: still delivered
        assert not stream.movable
