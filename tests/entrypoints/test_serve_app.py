"""`pagedllm.serve_app` on a local Ray Serve (the `serve` extra): the ingress app is built in its replica (a FastAPI
app built in the driver held thread pools and locks, and `@serve.ingress` refused to pickle it), one engine replica
of the tiny model answers the OpenAI API, and its greedy completion equals one offline engine's."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import pagedllm  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.engine.replica_pool import LOCAL_RAY_ENV, package_runtime_env  # noqa: E402

ENGINE_ARGS = dict(dtype="float32", attention_backend="reference", num_blocks=64, max_model_len=256)
PORT = 18767


@pytest.fixture(scope="module")
def serve_url(tiny_model_dir: str) -> Iterator[str]:
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    ray.init(num_cpus=2, include_dashboard=False, namespace="pagedllm-serve-test", log_to_driver=False,
             runtime_env=package_runtime_env())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        app = pagedllm.serve_app(model=tiny_model_dir, num_replicas=1, threads=1, **ENGINE_ARGS)
        serve.run(app, route_prefix="/", name="pagedllm")
        yield f"http://127.0.0.1:{PORT}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_the_serve_app_answers_as_one_offline_engine(serve_url: str, tiny_model_dir: str) -> None:
    prompt = "The library opens at nine and"
    body = {"model": tiny_model_dir, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{serve_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    offline = LLM(model=tiny_model_dir, threads=1, **ENGINE_ARGS).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert r.json()["choices"][0]["text"] == offline.text
    assert httpx.get(f"{serve_url}/health", timeout=30).status_code == 200
    assert httpx.post(f"{serve_url}/v1/completions", json={**body, "max_tokens": -1}, timeout=30).status_code == 400
