"""Issue 12: no request can take the server down, slow it for others, or lose another user's tokens.

Regressions for the four reported cases, fault injection (one request fails a step; an engine that cannot recover
is replaced), the event loop's bounds (body size, prompts no context can hold, tokenization off the loop) and slow
clients, against a real `pagedllm serve` on the tiny model with test faults on; the engine-level parts in-process.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedllm.bench.server_process import ServerProcess as Server
from pagedllm.config import EngineConfig
from pagedllm.engine.faults import ENV_VAR, FaultInjector
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.limits import SendDeadline
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
FAIL_SEED, FATAL_SEED = 4242, 4343
MAX_MODEL_LEN = 512


def metric(server: Server, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.split("{")[0].split(" ")[0] == f"pagedllm:{name}" and all(f'{k}="{v}"' in line
                                                                          for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model served with test faults on and short client timeouts."""
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), ENV_VAR: f"fail_seed={FAIL_SEED},fatal_seed={FATAL_SEED}"}
    argv = ["--model", tiny_model_dir, "--dtype", "float32", "--threads", "1", "--num-blocks", "640",
            "--max-model-len", str(MAX_MODEL_LEN), "--body-timeout", "2", "--stream-send-timeout", "2"]
    with Server(argv, str(log), timeout=120, env=env) as s:
        yield s


def completion(server: Server, timeout: float = 60, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, **body},
                      timeout=timeout)


# ---- the issue's four cases -----------------------------------------------------------------------------
def test_huge_seed_is_a_400_and_never_reaches_a_step(server: Server) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            good = {"prompt": "Others are served", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            bad = {"prompt": "hi there", "max_tokens": 50, "seed": 10**30}
            return await asyncio.gather(*(http.post("/v1/completions", json=good if i % 2 else bad)
                                          for i in range(16)))

    responses = asyncio.run(run())
    for i, r in enumerate(responses):
        if i % 2:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1})
    assert chat.status_code == 400
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert completion(server, seed=2**63 - 1, n=2, temperature=1.0).status_code == 200  # the edge still works


def test_huge_body_is_refused_at_once(server: Server) -> None:
    body = b'{"prompt": "' + b"word " * (8 << 20) + b'"}'  # 40 MB
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"word " * (1 << 18)
        yield b'"}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_lone_surrogate_is_a_400(server: Server) -> None:
    cases = [("/v1/completions", '{"prompt": "\\ud800 hi"}'),
             ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}'),
             ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}'),
             ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800 hi"}]}'),
             ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}'),
             ("/tokenize", '{"prompt": "\\ud800 hi"}')]
    for path, body in cases:
        r = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, body, r.text)
        assert "Unicode" in r.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", content='{"prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}',
                    headers={"Content-Type": "application/json"})
    assert ok.status_code == 200  # a surrogate pair is an emoji, not an error


@pytest.mark.parametrize("messages", [[{"role": "wizard", "content": "hi"}], [{"role": "user"}],
                                      [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]])
def test_chat_role_and_content_are_checked(server: Server, messages: list[dict]) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_assistant_tool_call_without_content_is_fine(server: Server) -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                      "function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "1"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [{"temperature": 1e308 * 10}, {"n": 10**6}, {"top_k": 10**30},
                                  {"stop": ["x"] * 1000}, {"stop": "y" * 5000}, {"max_tokens": 10**30},
                                  {"logit_bias": {str(i): 1.0 for i in range(1000)}}, {"stop_token_ids": [1] * 10**4},
                                  {"prompt": [[1]] * 1000}, {"prompt": [10**30]}, {"min_tokens": 10**30}])
def test_absurd_values_are_400s(server: Server, body: dict) -> None:
    content = json.dumps({"prompt": "hi", **body}).replace("Infinity", "1e999")
    r = httpx.post(f"{server.url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text


# ---- fault injection ----------------------------------------------------------------------------------
def test_a_step_failure_fails_only_its_request(server: Server) -> None:
    before_failed = metric(server, "request_success_total", finished_reason="abort")

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            good = {"prompt": "Keep going", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            tasks = [http.post("/v1/completions", json=good) for _ in range(6)]
            await asyncio.sleep(0)
            tasks.insert(3, http.post("/v1/completions", json={"prompt": "poison", "seed": FAIL_SEED,
                                                                "max_tokens": 24}))
            return await asyncio.gather(*tasks)

    reference = completion(server, prompt="Keep going", max_tokens=24, temperature=0, ignore_eos=True).json()
    responses = asyncio.run(run())
    assert responses[3].status_code == 500 and "failed" in responses[3].json()["error"]["message"]
    for r in responses[:3] + responses[4:]:
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == reference["choices"][0]["text"]  # tokens intact
    assert metric(server, "request_success_total", finished_reason="abort") == before_failed + 1
    assert metric(server, "engine_restarts_total") == 0
    wait_until(lambda: metric(server, "kv_blocks_in_use") == 0 and metric(server, "num_requests_running") == 0)


def test_an_engine_that_cannot_recover_is_replaced(server: Server) -> None:
    restarts = metric(server, "engine_restarts_total")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "in flight", "max_tokens": 400,
                                                          "ignore_eos": True, "stream": True}) as inflight:
            lines = inflight.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            fatal = http.post("/v1/completions", json={"prompt": "break it", "seed": FATAL_SEED, "max_tokens": 4})
            assert fatal.status_code == 503 and fatal.json()["error"]["code"] == "engine_restarting"
            assert fatal.headers["Retry-After"]
            rest = [line for line in lines if line.startswith("data:")]
        assert any("engine_restarting" in line for line in rest) and rest[-1] == "data: [DONE]"
        wait_until(lambda: http.get("/health").status_code == 200, timeout=240)
        assert metric(server, "engine_restarts_total") == restarts + 1
        assert completion(server).status_code == 200
    assert "restarting it" in Path(server.log_path).read_text()


def test_engine_isolates_the_failing_request_in_process(tiny_model_dir: str) -> None:
    """Bisection inside one step: the poisoned request among seven (prompts and decodes) fails alone; the others'
    greedy tokens equal a run without it, and the pool is consistent throughout."""
    config = EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=64, threads=1,
                          attention_backend="reference")
    engine = LLMEngine(config, faults=FaultInjector(fail_seed=FAIL_SEED))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [f"request number {i} says" for i in range(6)]

    def run(poison_at: int | None) -> dict[str, list[int]]:
        for i, p in enumerate(prompts[:3]):
            engine.add_request(f"r{i}", p, greedy)
        engine.step()  # these three are decoding when the others arrive
        for i, p in enumerate(prompts[3:], start=3):
            engine.add_request(f"r{i}", p, greedy)
        if poison_at is not None:
            engine.add_request("poison", "x y z", SamplingParams(seed=FAIL_SEED, max_tokens=12))
        done = {}
        failed = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            failed.update(engine.pop_failed_requests())
            engine.check_invariants()
        assert set(failed) == ({"poison"} if poison_at is not None else set())
        assert engine.stats().blocks_in_use == 0
        return {k: v for k, v in done.items() if k != "poison"}

    assert run(poison_at=6) == run(poison_at=None)


def test_seed_out_of_range_fails_at_add_request(tiny_model_dir: str) -> None:
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=10**30)
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=16, threads=1))
    params = SamplingParams(n=2, seed=0, temperature=1.0)
    params.seed = 2**64 - 1  # past validation: the generator of sample 1 (seed + 1) cannot be made
    with pytest.raises(InvalidRequestError, match="seed"):
        engine.add_request("r", "hello", params)
    assert not engine.has_unfinished_requests() and not engine.runner.seeds


# ---- the event loop's bounds and slow clients ------------------------------------------------------------------
def test_prompt_no_context_can_hold_is_refused_before_tokenizing(server: Server) -> None:
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN
    r = completion(server, prompt="word " * 400_000)  # 2 MB of text: more characters than any 512 tokens hold
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "word " * 400_000})
    assert r.status_code == 400


def test_health_answers_while_a_big_prompt_tokenizes(server: Server) -> None:
    """A prompt as long as the context allows is tokenized in a worker thread; /health answers meanwhile."""
    big = "abc " * 10_000  # 40 KB, tokenized off the loop, then too many tokens for the context: a 400
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(completion(server, prompt=big))) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(10):
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 2.0
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [400] * 4


def test_tokenize_runs_in_a_worker_thread_for_long_prompts() -> None:
    from pagedllm.entrypoints.openai.limits import OFF_LOOP_CHARS
    from pagedllm.entrypoints.openai.serving import ServerContext

    threads: list[str] = []

    class Engine:
        def tokenize_prompt(self, prompt: str) -> list[int]:
            threads.append(threading.current_thread().name)
            return [1]

    ctx = ServerContext(Engine(), None, ["m"], None)  # type: ignore[arg-type]
    asyncio.run(ctx.tokenize("x" * (OFF_LOOP_CHARS + 1), "prompt"))
    asyncio.run(ctx.tokenize("short", "prompt"))
    assert threads[0].startswith("pagedllm-tokenize") and threads[1] == "MainThread"


def raw_connection(server: Server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    return sock


def test_slow_body_gets_408_and_slow_headers_slow_nobody(server: Server) -> None:
    body = json.dumps({"prompt": "slow", "max_tokens": 2}).encode()
    slow_body = raw_connection(server)
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
    slow_headers = raw_connection(server)
    for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":
        slow_headers.send(bytes([byte]))  # a header trickles in while others are served
        if byte == ord("\n"):
            assert completion(server).status_code == 200
    slow_body.settimeout(30)
    reply = slow_body.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    slow_body.close()
    slow_headers.close()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_send_deadline_cancels_a_send_that_waits_too_long_and_no_other():
    """One timer per stream: sends that each finish in time never trip it, however long the stream lasts; the first
    send that waits past the timeout cancels the stream's task."""
    sent: list[float] = []

    async def send(seconds: float) -> None:  # a send that blocks this long, as one to a full socket does
        await asyncio.sleep(seconds)
        sent.append(seconds)

    async def stream(delays: list[float]) -> str:
        deadline = SendDeadline(send, 0.5)
        try:
            for d in delays:
                await deadline.send(d)
        except asyncio.CancelledError:
            assert deadline.expired
            return "expired"
        finally:
            deadline.close()
        assert not deadline.expired
        return "done"

    async def main() -> tuple[str, str]:
        quick = await asyncio.create_task(stream([0.02] * 60))  # ~1.2 s in all, each send well inside 0.5 s
        slow = await asyncio.create_task(stream([0.02, 3.0, 0.02]))
        return quick, slow

    assert asyncio.run(main()) == ("done", "expired")
    assert sent == [0.02] * 61  # the slow send never completed, and nothing after it ran


def test_a_stream_nobody_reads_is_dropped(server: Server) -> None:
    """A client that stops reading its stream fills the socket; after --stream-send-timeout (2 s) of blocked sends
    the server drops the stream (aborting the request if it still runs), so it holds nothing for long. 16 choices of
    480 tokens with 20 logprobs each make ~7 MB of events, more than the socket buffers hold."""
    body = json.dumps({"prompt": "never read", "max_tokens": 480, "ignore_eos": True, "stream": True,
                       "logprobs": 20, "n": 16}).encode()
    sock = raw_connection(server, rcvbuf=4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        wait_until(lambda: "client read nothing" in Path(server.log_path).read_text(), timeout=120)
        wait_until(lambda: metric(server, "kv_blocks_in_use") == 0 and metric(server, "num_requests_running") == 0)
    finally:
        sock.close()
