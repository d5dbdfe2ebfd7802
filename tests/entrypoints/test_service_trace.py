"""`pagedllm serve --scheduling-policy fair --service-trace FILE` on the tiny model: clients named by `user` and by
the X-Client-Id header, the per-client metrics, and VTC's bound checked on the trace the server recorded."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from test_server import launch, metric, metrics

from pagedllm.core.fairness import INPUT_WEIGHT, OUTPUT_WEIGHT, max_service_gap
from pagedllm.core.service import service_bound
from pagedllm.entrypoints.service_trace import read_service_trace

NUM_BLOCKS, BLOCK_SIZE = 8, 16
HEAVY = (10, 40, 16)  # requests, prompt tokens, output tokens
LIGHT = (4, 8, 4)


def complete(url: str, prompt_len: int, max_tokens: int, user: str | None = None,
             header: str | None = None) -> dict:
    rng = random.Random(f"{user}{header}{prompt_len}")
    body = {"prompt": [rng.randrange(100, 40000) for _ in range(prompt_len)], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, **({"user": user} if user else {})}
    response = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Client-Id": header} if header else {},
                          timeout=120)
    response.raise_for_status()
    return response.json()


def test_fair_server_keeps_the_bound_on_its_recorded_trace(tiny_model_dir, tmp_path: Path):
    trace = tmp_path / "service.jsonl"
    with launch(tiny_model_dir, tmp_path / "server.log", "--num-blocks", str(NUM_BLOCKS), "--block-size",
                str(BLOCK_SIZE), "--max-model-len", "128", "--max-num-seqs", "2", "--scheduling-policy", "fair",
                "--service-trace", str(trace)) as server:
        with ThreadPoolExecutor(12) as pool:
            heavy = [pool.submit(complete, server.url, HEAVY[1], HEAVY[2], user="heavy") for _ in range(HEAVY[0])]

            def light(**who: str) -> None:
                for _ in range(LIGHT[0]):
                    complete(server.url, LIGHT[1], LIGHT[2], **who)

            lights = [pool.submit(light, user="alice"), pool.submit(light, header="bob", user="ignored")]
            for f in heavy + lights:
                f.result()
        samples = metrics(server)
    served, _ = read_service_trace(str(trace))[-1]
    assert served == {"heavy": HEAVY[0] * (INPUT_WEIGHT * HEAVY[1] + OUTPUT_WEIGHT * HEAVY[2]),
                      "alice": LIGHT[0] * (INPUT_WEIGHT * LIGHT[1] + OUTPUT_WEIGHT * LIGHT[2]),
                      "bob": LIGHT[0] * (INPUT_WEIGHT * LIGHT[1] + OUTPUT_WEIGHT * LIGHT[2])}
    assert max_service_gap(read_service_trace(str(trace))) <= service_bound(HEAVY[1], NUM_BLOCKS * BLOCK_SIZE)
    assert metric(samples, "client_requests_total", client="bob") == LIGHT[0]
    assert metric(samples, "client_generation_tokens_total", client="heavy") == HEAVY[0] * HEAVY[2]
    assert metric(samples, "client_prompt_tokens_total", client="alice") == LIGHT[0] * LIGHT[1]
    assert metric(samples, "client_requests_total", client="ignored") == 0
    assert metric(samples, "priority_requests_total", priority="0") == HEAVY[0] + 2 * LIGHT[0]
    assert metric(samples, "client_request_queue_time_seconds_count", client="heavy") == HEAVY[0]
