"""`pagedllm serve --data-parallel-size 2` on a local Ray (2 CPUs, the tiny model, 1 thread per replica): greedy
outputs equal one engine's, a shared prefix stays on one replica, /metrics and /health show both replicas, the
dashboard shows each replica's own KV pool (`?replica=i`, its data endpoints and the page in headless Chromium),
and a replica killed mid-run loses no request that had not started streaming.

One Ray instance and one server for the module: Ray's start-up is most of the time these tests take."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import no_retry_client
from test_dashboard import browser, open_page  # noqa: F401 (browser is a fixture)

ray = pytest.importorskip("ray")

from pagedllm.bench.server_process import ServerProcess  # noqa: E402
from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.engine.replica_pool import LOCAL_RAY_ENV, NAMESPACE  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ENGINE_ARGS = dict(dtype="float32", threads=1, attention_backend="reference", num_blocks=192, max_model_len=1024)
SHARED = ("You are a careful assistant for a library. Answer every question about the catalogue in one short "
          "sentence, and say so when you do not know. The catalogue lists books, maps and recordings. ")
PROMPTS = [SHARED + q for q in ("Do you have maps of Lyon?", "Who wrote the recordings?", "Is there a book on owls?",
                                "When does the library open?", "Can I borrow two maps?", "Where are the novels?")]


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    ray.init(num_cpus=2, include_dashboard=False, namespace="pagedllm-test", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def dp_server(ray_address: str, tiny_model_dir: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("dp-server") / "server.log"
    argv = ["--model", tiny_model_dir, "--data-parallel-size", "2", "--ray-address", ray_address,
            "--max-num-seqs", "2", "--routing-margin", "4"]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    env = {**os.environ, **LOCAL_RAY_ENV, "PYTHONPATH": str(REPO)}
    with ServerProcess(argv, str(log), timeout=300, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str):
    """One engine's greedy completions of a prompt (the same config as each replica)."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, **ENGINE_ARGS))
    cache: dict[tuple[str, int], str] = {}

    def complete(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in cache:
            engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            while engine.has_unfinished_requests():
                outs = engine.step()
            cache[prompt, max_tokens] = outs[0].outputs[0].text
        return cache[prompt, max_tokens]

    return complete


@pytest.fixture(scope="module")
def client(dp_server: ServerProcess) -> openai.OpenAI:
    """No retries (a lost request must show); its idle connections expire before the server's keep-alive closes them
    (one reused as the server closed it gave "Server disconnected without sending a response")."""
    return no_retry_client(openai.OpenAI, f"{dp_server.url}/v1", api_key="unused", timeout=120)


def health(server: ServerProcess) -> dict:
    response = httpx.get(f"{server.url}/health", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def routed(server: ServerProcess) -> list[int]:
    return [r["routed"] for r in health(server)["replicas"]]


def complete(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def test_outputs_equal_one_engines(dp_server: ServerProcess, client: openai.OpenAI, reference) -> None:
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "def fib(n):", *PROMPTS[:2]]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: complete(client, p, 24), prompts))
    assert texts == [reference(p, 24) for p in prompts]
    assert all(n > 0 for n in routed(dp_server))  # concurrent distinct prompts went to both replicas


def test_a_shared_prefix_stays_on_one_replica(dp_server: ServerProcess, client: openai.OpenAI, reference) -> None:
    before = routed(dp_server)
    for prompt in PROMPTS:  # one at a time: the prefix's replica is never busier than the margin allows
        assert complete(client, prompt, 8) == reference(prompt, 8)
    after = routed(dp_server)
    moved = [a - b for a, b in zip(after, before)]
    assert sorted(moved) == [0, len(PROMPTS)], moved


def test_metrics_show_both_replicas(dp_server: ServerProcess) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[tuple[str, str], float]:
        text = httpx.get(f"{dp_server.url}/metrics", timeout=10).text
        return {(s.name, s.labels.get("replica", "")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def shown(s: dict[tuple[str, str], float]) -> bool:  # replicas' series arrive as they report, not at once
        return (all(s.get(("pagedllm:prompt_tokens_total", r), 0) > 0 for r in "01")
                and max(s.get(("pagedllm:prefix_cache_hits_total", r), 0) for r in "01") > 0)

    wait_until(lambda: shown(samples()))
    s = samples()
    assert all(s[("pagedllm:router_requests_total", r)] > 0 for r in "01")
    assert s[("pagedllm:router_affinity_hits_total", "")] >= len(PROMPTS) - 1
    assert s[("pagedllm:replica_healthy", "0")] == s[("pagedllm:replica_healthy", "1")] == 1


def frame(server: ServerProcess, replica: int) -> dict:
    response = httpx.get(f"{server.url}/dashboard/snapshot", params={"replica": replica}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def replica_metric(server: ServerProcess, name: str, replica: int) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and s.labels.get("replica") == str(replica))


def pool_agrees_with_counters(f: dict) -> bool:
    """The hub's copy of the replica's pool (rebuilt from the replica's diffs) holds as many used and cached blocks
    as the replica's own counters say."""
    states = f["blocks"][1::3]
    in_use = sum(1 for s in states if s in (1, 2, 4))
    return in_use == f["counters"]["blocks_in_use"] and states.count(3) == f["counters"]["blocks_cached_free"]


def settled(server: ServerProcess, replica: int) -> bool:
    """Idle, and the replica's snapshot agrees with the replica's /metrics series (its last health check)."""
    f = frame(server, replica)
    c = f["counters"]
    return (c["num_running"] == c["num_waiting"] == 0 and pool_agrees_with_counters(f)
            and c["generated_tokens"] == replica_metric(server, "pagedllm:generation_tokens_total", replica))


def test_the_dashboard_shows_each_replicas_own_pool(dp_server: ServerProcess, client: openai.OpenAI) -> None:
    info = httpx.get(f"{dp_server.url}/dashboard/info", params={"replica": 1}, timeout=10).json()
    assert info["mode"] == "live" and info["replica"] == 1
    assert [r["replica"] for r in info["replicas"]] == [0, 1] and all(r["healthy"] for r in info["replicas"])
    assert httpx.get(f"{dp_server.url}/dashboard/info", params={"replica": 2}, timeout=10).status_code == 404
    for replica in (0, 1):  # both served the tests above; once idle, each frame is that replica's own
        wait_until(lambda r=replica: settled(dp_server, r))
        f = frame(dp_server, replica)
        assert f["full"] and f["num_blocks"] == ENGINE_ARGS["num_blocks"] and f["counters"]["generated_tokens"] > 0
        assert f["counters"]["prefix_cache_queries"] == replica_metric(
            dp_server, "pagedllm:prefix_cache_queries_total", replica)
    # a long request shows in its replica's frames only, holding blocks there
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(complete, client, "Once upon a time, in a land far away,", 900)
        wait_until(lambda: any(r["in_flight"] for r in health(dp_server)["replicas"]))
        busy = next(r["replica"] for r in health(dp_server)["replicas"] if r["in_flight"])
        wait_until(lambda: frame(dp_server, busy)["requests"])
        (request,) = frame(dp_server, busy)["requests"]
        assert request["status"] == "running" and request["samples"][0]["block_table"]
        assert frame(dp_server, 1 - busy)["requests"] == []
        with httpx.stream("GET", f"{dp_server.url}/dashboard/events", params={"replica": busy}, timeout=60) as r:
            first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
        assert first["full"] and [q["request_id"] for q in first["requests"]] == [request["request_id"]]
        job.result(timeout=300)
    wait_until(lambda: settled(dp_server, busy))  # the final state after the burst: its blocks let go


def test_the_dashboard_page_selects_a_replica(dp_server: ServerProcess, browser) -> None:  # noqa: F811
    page = open_page(browser, f"{dp_server.url}/dashboard?replica=1")
    shown = page.evaluate("() => ({replica: window.dashboardState.replica, "
                          "replicas: window.dashboardState.replicas.length, counters: window.dashboardState.counters})")
    assert shown["replica"] == 1 and shown["replicas"] == 2
    assert shown["counters"]["generated_tokens"] == frame(dp_server, 1)["counters"]["generated_tokens"]
    assert page.locator("#replicas a.replica").count() == 2
    assert "replica 1 of 2" in page.locator("#meta").text_content()
    with page.expect_navigation():
        page.locator('#replicas a[data-replica="0"]').click()
    page.wait_for_function("window.dashboardState.replica === 0 && window.dashboardState.framesReceived > 0")
    counters = page.evaluate("() => window.dashboardState.counters")
    assert counters["generated_tokens"] == frame(dp_server, 0)["counters"]["generated_tokens"]
    assert page.errors == []


def test_a_killed_replica_loses_no_request_that_had_not_started_streaming(
        dp_server: ServerProcess, client: openai.OpenAI, reference) -> None:
    """Ten long requests, streamed and not, two running per replica and the rest queued; replica 0's actor is
    killed mid-run. Non-streamed requests all complete with one engine's output (started over elsewhere); a streamed
    one may fail only after its first token; the server stays healthy and Ray brings the replica back."""
    model = client.models.list().data[0].id
    prompts = [f"Request {i}: tell a long story about the number {i}." for i in range(10)]
    max_tokens = 160

    def streamed(prompt: str) -> tuple[str, int, Exception | None]:
        text, chunks = "", 0
        try:
            for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text if chunk.choices else ""
                chunks += 1
        except openai.APIError as e:
            return text, chunks, e
        return text, chunks, None

    name = health(dp_server)["replicas"][0]["actor"]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, client, p, max_tokens) if i % 2 == 0 else pool.submit(streamed, p)
                   for i, p in enumerate(prompts)]
        wait_until(lambda: health(dp_server)["replicas"][0]["num_running"], timeout=60)
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=False)
        results = [f.result(timeout=300) for f in futures]
    for i, result in enumerate(results):
        if i % 2 == 0:
            assert result == reference(prompts[i], max_tokens)  # non-streamed: never lost
        else:
            text, chunks, error = result
            if error is None:
                assert text == reference(prompts[i], max_tokens)
            else:  # only a request that had started streaming may fail, with a clean error event
                assert chunks > 0 and "replica 0 failed" in str(error), (chunks, error)
    assert health(dp_server)["status"] == "ok"
    wait_until(lambda: all(r["healthy"] for r in health(dp_server)["replicas"]), timeout=120)
    assert health(dp_server)["replicas"][0]["restarts"] == 1
    assert complete(client, "The capital of France is", 24) == reference("The capital of France is", 24)
    text = httpx.get(f"{dp_server.url}/metrics", timeout=10).text
    reroutes = [line for line in text.splitlines() if line.startswith("pagedllm:router_reroutes_total{")]
    assert float(reroutes[0].split()[-1]) >= 1  # replica 0's queued requests went to replica 1
    wait_until(lambda: settled(dp_server, 0))  # the dashboard follows the new incarnation's pool
