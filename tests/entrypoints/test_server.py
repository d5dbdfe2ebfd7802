"""The OpenAI-compatible server, against real `pagedllm serve` processes and the official `openai` client;
plus the async engine's failure handling on a fake engine (no model, no process)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from conftest import no_retry_client
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.bench.server_process import ServerProcess as Server
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineRestartingError
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

API_KEY = "sk-test-0123456789"
REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


# ---- server processes ------------------------------------------------------------------------------------
def launch(model_dir: str, log: Path, *args: str) -> Server:
    """`pagedllm serve` on the tiny model (this tree's pagedllm), started when its `with` is entered."""
    return Server(["--model", model_dir, "--dtype", "float32", "--threads", "1", "--attention-backend", "reference",
                   *args], str(log), timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def servers(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """Two servers started together: a roomy one for most tests, a tight one (one running sequence, two
    waiting requests, an API key) for backpressure and auth."""
    logs = tmp_path_factory.mktemp("server-logs")
    with (launch(tiny_model_dir, logs / "main.log", "--num-blocks", "192", "--max-model-len", "1024") as main,
          launch(tiny_model_dir, logs / "small.log", "--num-blocks", "64", "--max-num-seqs", "1",
                 "--max-waiting-requests", "2", "--api-key", API_KEY) as small):
        yield main, small
    assert "Traceback" not in Path(main.log_path).read_text(errors="replace"), main.log_tail()


@pytest.fixture(scope="module")
def server(servers: tuple[Server, Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def small_server(servers: tuple[Server, Server]) -> Server:
    return servers[1]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return no_retry_client(openai.OpenAI, f"{server.url}/v1", api_key="unused", timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def metrics(server: Server) -> dict[tuple, float]:
    """Every sample of /metrics, keyed by (name, labels without model_name)."""
    text = httpx.get(f"{server.url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def metric(samples: dict[tuple, float], name: str, **labels: str) -> float:
    return samples.get((f"pagedllm:{name}", tuple(sorted(labels.items()))), 0.0)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# ---- the openai client -----------------------------------------------------------------------------------
def test_models_health_version(server: Server, client: openai.OpenAI, tiny_model_dir: str) -> None:
    assert [m.id for m in client.models.list().data] == [tiny_model_dir]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_stream_equals_non_stream_and_usage(client: openai.OpenAI, model: str,
                                                       tokenizer: Tokenizer) -> None:
    prompt = "The capital of France is"
    kw = dict(model=model, prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 20
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_speculative_steps_stream_the_same_text_and_count_in_metrics(server: Server, client: openai.OpenAI,
                                                                    model: str) -> None:
    """A greedy request alone runs speculative steps (several tokens a step): streamed text equals the whole text,
    the usage counts every token, and /metrics counts the proposals."""
    before = metrics(server)
    prompt = [1000, 2000, 3000, 4000, 5000] * 6  # repeats itself: the lookup proposes from the start
    kw = dict(model=model, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 40
    after = metrics(server)
    assert metric(after, "spec_decode_num_draft_tokens_total") > metric(before, "spec_decode_num_draft_tokens_total")
    assert metric(after, "spec_decode_num_accepted_tokens_total") > metric(before,
                                                                          "spec_decode_num_accepted_tokens_total")


def test_chat_stream_equals_non_stream_and_usage(server: Server, client: openai.OpenAI, model: str,
                                                 tokenizer: Tokenizer) -> None:
    kw = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True),
                                  add_special_tokens=False)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 16
    assert httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"] == prompt_ids

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == len(prompt_ids)


def one_prompt_tokens(client: openai.OpenAI, model: str, prompt: str) -> int:
    return client.completions.create(model=model, prompt=prompt, max_tokens=1).usage.prompt_tokens


def test_n_and_seed(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in first.choices}) > 1  # seed + i: the samples differ
    assert first.usage.completion_tokens == 3 * 12  # every choice counts; the prompt counts once
    assert first.usage.prompt_tokens == one_prompt_tokens(client, model, kw["prompt"])
    one = client.completions.create(**{**kw, "n": 1, "seed": 1235})
    assert one.choices[0].text == first.choices[1].text  # choice i is the request seeded seed + i

    batch = client.completions.create(model=model, prompt=["Red", "Green and blue"], n=2, max_tokens=4,
                                      temperature=0, echo=True, extra_body={"ignore_eos": True})
    texts = [c.text for c in batch.choices]  # choice index = prompt * n + sample
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    assert texts[0].startswith("Red") and texts[2].startswith("Green and blue")
    expected_prompt_tokens = sum(one_prompt_tokens(client, model, p) for p in ("Red", "Green and blue"))
    assert batch.usage.prompt_tokens == expected_prompt_tokens

    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, n=2, seed=5,
                                          stream=True)
    texts = ["", ""]
    finished = set()
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(texts)


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()))  # greedy: the chosen token is the top one
        assert top[token] == pytest.approx(value)

    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert bytes(e.bytes).decode(errors="replace") == e.token


def test_stop_strings(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="Stop me if you can:", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw, max_tokens=24).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    expected = full[:full.find(stop)]
    out = client.completions.create(**kw, max_tokens=24, stop=[stop])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**kw, max_tokens=24, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


# ---- concurrency, disconnects, metrics -------------------------------------------------------------------
def test_32_concurrent_streams_are_batched(server: Server, model: str) -> None:
    prompts = ["One", "Two words", "A longer prompt of several words", "Numbers 1 2 3"]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int]:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, tokens = "", 0
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return text, tokens

    async def run() -> list[tuple[str, int]]:
        async with no_retry_client(openai.AsyncOpenAI, f"{server.url}/v1", api_key="x") as client:
            return await asyncio.gather(*(one(client, prompts[i % 4]) for i in range(32)))

    results = asyncio.run(run())
    assert all(tokens == 24 for _, tokens in results)
    for i in range(4):  # greedy output does not depend on the batch it ran in
        assert len({text for j, (text, _) in enumerate(results) if j % 4 == i}) == 1
    samples = metrics(server)
    assert metric(samples, "num_requests_running_max") > 1
    assert metric(samples, "num_requests_running") == 0 and metric(samples, "kv_cache_usage_perc") == 0


def test_disconnect_aborts_and_frees_blocks(server: Server, model: str) -> None:
    before = metric(metrics(server), "request_success_total", finished_reason="abort")
    body = {"model": model, "prompt": "Go on and on", "max_tokens": 1000, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")) >= 3
            busy = metrics(server)
            assert metric(busy, "kv_cache_usage_perc") > 0
            assert 0 <= metric(busy, "kv_waste_fraction") < 1  # one sequence: only its last block's tail
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up while waiting
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))

    def settled() -> bool:
        s = metrics(server)
        return (metric(s, "request_success_total", finished_reason="abort") == before + 2
                and metric(s, "num_requests_running") == 0 and metric(s, "kv_cache_usage_perc") == 0)

    wait_until(settled)


def test_metrics_move(server: Server, client: openai.OpenAI, model: str, tokenizer: Tokenizer) -> None:
    before = metrics(server)
    prompt = "Count the tokens in this prompt"
    client.completions.create(model=model, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True})
    after = metrics(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("prompt_tokens_total") == len(tokenizer.encode(prompt))
    assert delta("generation_tokens_total") == 7
    assert delta("request_success_total", finished_reason="length") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"{hist}_count") == 1
    assert delta("inter_token_latency_seconds_count") == 6
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (f"pagedllm:{gauge}", ()) in after
    assert ("pagedllm:num_preemptions_total", ()) in after

    long_prompt = " ".join(["word"] * 40)  # 40 tokens: the second request finds 2 full blocks of 16 cached
    for _ in range(2):
        client.completions.create(model=model, prompt=long_prompt, max_tokens=1)
    final = metrics(server)
    assert metric(final, "prefix_cache_hits_total") - metric(after, "prefix_cache_hits_total") >= 32
    assert metric(final, "prefix_cache_queries_total") - metric(after, "prefix_cache_queries_total") >= 80


# ---- errors ----------------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ERROR_CASES = [
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": ', 400),  # malformed JSON
    (COMPLETIONS, b"[1, 2, 3]", 400),  # JSON, but not an object
    (COMPLETIONS, {"max_tokens": 5}, 400),  # no prompt
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "many"}, 400),
    (COMPLETIONS, {"prompt": {"text": "hi"}}, 400),
    (CHAT, {"messages": "hello"}, 400),
    (CHAT, {"messages": []}, 400),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "hi"}, 404),
    (CHAT, {"model": "gpt-4", "messages": MESSAGES}, 404),
    (COMPLETIONS, {"prompt": [100] * 1100}, 400),  # longer than the context
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 5000}, 400),  # prompt + max_tokens beyond the context
    (CHAT, {"messages": MESSAGES, "max_tokens": 5000}, 400),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400),
    (COMPLETIONS, {"prompt": "hi", "top_k": -5}, 400),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, 400),
    (COMPLETIONS, {"prompt": "hi", "n": 100000}, 400),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, 400),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400),
    (COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400),
    (COMPLETIONS, {"prompt": [10**9]}, 400),  # token id outside the vocabulary
    (COMPLETIONS, {"prompt": ""}, 400),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400),  # top_logprobs without logprobs
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), ERROR_CASES)
def test_bad_requests_get_openai_errors(server: Server, path: str, body: dict | bytes, status: int) -> None:
    if isinstance(body, bytes):
        r = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(f"{server.url}{path}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]


def test_errors_through_the_client_and_still_serving(server: Server, client: openai.OpenAI,
                                                     model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    r = httpx.get(f"{server.url}/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert client.completions.create(model=model, prompt="still alive?", max_tokens=3).usage.completion_tokens
    assert server.proc.poll() is None


# ---- backpressure and auth (the tight server) ------------------------------------------------------------
def test_overload_gets_503_with_retry_after(small_server: Server) -> None:
    body = {"prompt": "Overload", "max_tokens": 48, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=small_server.url, headers=headers, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(run())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}, statuses
    assert statuses.count(200) >= 2
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "server_overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 48
    again = httpx.post(f"{small_server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert again.status_code == 200


def test_api_key(small_server: Server) -> None:
    url = small_server.url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{url}/v1/completions", content=b"{bad json").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        no_retry_client(openai.OpenAI, f"{url}/v1", api_key="wrong").models.list()
    good = no_retry_client(openai.OpenAI, f"{url}/v1", api_key=API_KEY)
    assert good.completions.create(model=good.models.list().data[0].id, prompt="hi", max_tokens=2).choices


# ---- the async engine on a fake engine -------------------------------------------------------------------
class FakeEngine:
    """Just enough of LLMEngine: every step gives each request one token until it has `length` of them, taking
    `step_s` (so that a test sets `fail` before a long request ends, however late a loaded machine runs it).
    Prompt [13] is rejected on add; `fail` makes step() raise (the engine cannot go on)."""

    model_name = "fake"
    max_model_len = 64
    max_prompt_chars = None
    tokenizer = None

    def __init__(self, length: int = 3, step_s: float = 0.0) -> None:
        self.length, self.step_s = length, step_s
        self.tokens: dict[str, list[int]] = {}
        self.steps = 0
        self.fail: Exception | None = None
        self.broken = False
        self.model_config = SimpleNamespace(vocab_size=100)

    def tokenize_prompt(self, prompt: list[int]) -> list[int]:
        return list(prompt)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if prompt == [13]:
            raise ValueError("unlucky prompt")
        self.tokens[request_id] = []

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id not in self.tokens:
            return None
        return self._output(request_id, "abort")

    def fail_running(self) -> list[RequestOutput]:
        return [self._output(request_id, "abort") for request_id in list(self.tokens)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.tokens)

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_usage=0.0, kv_slots_held=0, preemptions=0, prefix_cache_queries=0,
                               prefix_cache_hits=0)

    @property
    def num_running(self) -> int:
        return len(self.tokens)

    num_waiting = 0

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.step_s:
            time.sleep(self.step_s)
        if self.fail is not None:
            raise self.fail
        outputs = []
        for request_id, tokens in list(self.tokens.items()):
            tokens.append(len(tokens))
            outputs.append(self._output(request_id, "length" if len(tokens) == self.length else None))
        return outputs

    def pop_failed_requests(self) -> dict[str, BaseException]:
        return {}

    def _output(self, request_id: str, reason: str | None) -> RequestOutput:
        tokens = self.tokens[request_id] if reason is None else self.tokens.pop(request_id)
        completion = CompletionOutput(0, "x" * len(tokens), list(tokens), 0.0, None, reason)
        return RequestOutput(request_id, None, [1], [completion], reason is not None)


async def drain(stream) -> list[RequestOutput]:
    return [out async for out in stream]


def test_async_engine_bad_request_fails_alone_and_idle_does_not_spin() -> None:
    fake = FakeEngine()

    async def run() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        try:
            good = engine.add_request("good", [1, 2], SamplingParams())
            bad = engine.add_request("bad", [13], SamplingParams())
            with pytest.raises(ValueError, match="unlucky"):
                await drain(bad)
            outs = await drain(good)
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3  # outputs are cumulative
            steps = fake.steps
            await asyncio.sleep(0.3)
            assert fake.steps == steps  # idle: the loop sleeps on its event
            assert engine.is_alive
            assert len((await drain(engine.generate("again", [1], SamplingParams())))[-1].outputs[0].token_ids) == 3
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_async_engine_without_factory_dies_on_a_step_failure_and_fails_everything() -> None:
    fake = FakeEngine(length=1000, step_s=0.005)  # 5 s to set `fail` before the request ends

    async def run() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        try:
            stream = engine.add_request("a", [1], SamplingParams())
            await stream.__anext__()
            fake.fail = RuntimeError("kernel exploded")
            with pytest.raises(EngineDeadError, match="kernel exploded"):
                await drain(stream)
            assert not engine.is_alive
            with pytest.raises(EngineDeadError):
                engine.add_request("c", [1], SamplingParams())
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_async_engine_with_factory_restarts_and_serves_again() -> None:
    broken, fresh = FakeEngine(length=1000, step_s=0.005), FakeEngine(length=3)
    restarts = []

    class Observer:
        def record(self, engine: object, outputs: list) -> None:
            pass

        def record_restart(self) -> None:
            restarts.append(1)

    async def run() -> None:
        engine = AsyncLLMEngine(broken, observer=Observer(), engine_factory=lambda: fresh)
        engine.start()
        try:
            stream = engine.add_request("a", [1], SamplingParams())
            await stream.__anext__()
            broken.fail = RuntimeError("kernel exploded")
            with pytest.raises(EngineRestartingError, match="kernel exploded.*retry"):
                await drain(stream)
            for _ in range(100):
                if engine.is_alive:
                    break
                await asyncio.sleep(0.05)
            assert engine.is_alive and engine.num_restarts == 1 and restarts == [1]
            assert (await drain(engine.add_request("b", [1], SamplingParams())))[-1].outputs[0].token_ids == [0, 1, 2]
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_dead_engine_gives_503s_not_hangs() -> None:
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.serve import build_app

    fake = FakeEngine(length=1000)
    app = build_app(fake, ["fake"])
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        fake.fail = RuntimeError("kernel exploded")
        r = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5})
        assert r.status_code == 503


def test_build_off_main_thread_returns_or_raises_what_the_factory_does() -> None:
    """A server's engine is built in a thread that then ends (its OpenMP pool with it; see build_off_main_thread)."""
    import threading

    from pagedllm.engine.async_engine import build_off_main_thread

    assert build_off_main_thread(lambda: threading.current_thread().name) == "pagedllm-build"
    with pytest.raises(ValueError, match="bad config"):
        build_off_main_thread(lambda: (_ for _ in ()).throw(ValueError("bad config")))
