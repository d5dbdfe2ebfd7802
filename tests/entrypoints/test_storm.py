"""Storms (issue 12): 1,000 requests with disconnects on a small KV pool, overload at 10x the waiting bound, and
20 long greedy requests preempting each other. Afterwards nothing is held and greedy output is unchanged.

The server runs in this process (uvicorn in a thread) so the test can check the engine's own invariants at the end.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from pagedllm.bench.server_process import free_port
from pagedllm.config import EngineConfig, ServerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.serve import build_app
from pagedllm.sampling_params import SamplingParams

REFERENCE = {"prompt": "The reference request, greedy in fp32:", "max_tokens": 32, "temperature": 0,
             "ignore_eos": True}


@contextmanager
def serve(engine: LLMEngine, **app_args) -> Iterator[str]:
    """`engine` behind the OpenAI server on a free local port, in a thread of this process."""
    server = uvicorn.Server(uvicorn.Config(build_app(engine, ["tiny"], ServerConfig(**app_args)), host="127.0.0.1",
                                           port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def settle(engine: LLMEngine) -> None:
    """Wait for the engine thread to finish what the aborts left (reads of plain ints from another thread)."""
    deadline = time.monotonic() + 60
    while engine.num_running or engine.num_waiting or engine.stats().blocks_in_use:
        assert time.monotonic() < deadline, (engine.num_running, engine.num_waiting, engine.stats())
        time.sleep(0.1)


def tiny_engine(model_dir: str, **overrides) -> LLMEngine:
    config = dict(model=model_dir, dtype="float32", threads=1, max_model_len=256)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


async def storm_request(http: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """One of the storm's requests: streaming or not, cut by its client or read to the end; the outcome."""
    max_tokens = rng.randint(4, 40)
    body = {"prompt": " ".join(rng.choice(["red", "green", "blue", "sky", "sea"]) for _ in range(rng.randint(2, 60))),
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": rng.choice([0, 0.8])}
    cut = rng.random() < 0.3
    if i % 2:  # streaming
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            stop_after = rng.randint(1, max_tokens)
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    stop_after -= 1
                    if cut and stop_after == 0:
                        return "cut"
            return "streamed"
    try:
        timeout = httpx.Timeout(120, read=rng.uniform(0.01, 0.3)) if cut else 120
        r = await http.post("/v1/completions", json=body, timeout=timeout)
    except httpx.ReadTimeout:
        return "cut"
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens  # every admitted request gets its full length
    return "done"


def test_storm_of_1000_requests_leaves_nothing_held(tiny_model_dir: str) -> None:
    engine = tiny_engine(tiny_model_dir, num_blocks=40)  # 640 token slots for up to 64 requests at once: preemption
    rng = random.Random(0)

    async def run(url: str) -> tuple[str, list[str], list[str]]:
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=80)) as http:
            reference = (await http.post("/v1/completions", json=REFERENCE)).json()["choices"][0]["text"]
            gate = asyncio.Semaphore(64)

            async def one(i: int) -> str:
                async with gate:
                    if i % 100 == 7:  # the reference again, mid-storm
                        r = await http.post("/v1/completions", json=REFERENCE)
                        return "reference:" + r.json()["choices"][0]["text"]
                    return await storm_request(http, rng, i)

            outcomes = await asyncio.gather(*(one(i) for i in range(1000)))
            after = (await http.post("/v1/completions", json=REFERENCE)).json()["choices"][0]["text"]
            return reference, [o for o in outcomes if not o.startswith("reference:")], \
                [o.removeprefix("reference:") for o in outcomes if o.startswith("reference:")] + [after]

    with serve(engine) as url:
        reference, outcomes, again = asyncio.run(run(url))
        settle(engine)
        stats = engine.stats()
        engine.check_invariants()
    assert len(outcomes) + len(again) == 1001 and outcomes.count("cut") > 100
    assert set(again) == {reference}  # greedy fp32 output unchanged by the storm
    assert stats.blocks_in_use == 0 and engine.num_running == 0 and engine.num_waiting == 0
    assert stats.preemptions > 0
    print(f"storm: {outcomes.count('cut')} cut by their client, {stats.preemptions} preemptions, "
          f"{stats.blocks_cached_free} cached-free prefix blocks of {stats.num_total_blocks}")


def test_overload_excess_gets_503_and_admitted_requests_complete(tiny_model_dir: str) -> None:
    engine = tiny_engine(tiny_model_dir, num_blocks=64, max_num_seqs=2)
    body = {"prompt": "Overloaded", "max_tokens": 24, "ignore_eos": True}

    async def run(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(80)))

    with serve(engine, max_waiting_requests=8) as url:
        responses = asyncio.run(run(url))
        settle(engine)
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 8, statuses
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "server_overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    assert engine.stats().blocks_in_use == 0


def test_preemption_storm_gives_each_request_its_solo_output(tiny_model_dir: str) -> None:
    """20 long greedy fp32 requests on a pool that holds about three of them: every one is preempted and
    recomputed, and its tokens equal those it gets alone."""
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 60))] for _ in range(20)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    engine = tiny_engine(tiny_model_dir, num_blocks=36, enable_prefix_caching=False)

    def run(ids: list[list[int]]) -> list[list[int]]:
        for i, p in enumerate(ids):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            engine.check_invariants()
        return [done[str(i)] for i in range(len(ids))]

    together = run(prompts)
    assert engine.stats().preemptions > 0
    assert together == [run([p])[0] for p in prompts]
    assert engine.stats().blocks_in_use == 0


@pytest.fixture(autouse=True)
def _quiet_uvicorn(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="uvicorn")
