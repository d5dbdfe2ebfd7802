"""Fuzzing (issue 12): schemathesis sends what the server's own OpenAPI schema allows, and what it does not, to every
endpoint; no response may be a 5xx, and the server must be healthy and serving afterwards.

PAGEDLLM_FUZZ_EXAMPLES sets the examples per operation, half valid and half not (default 80, for CI: at most 480
requests over the 8 operations); docs/reliability.md reports a longer run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from pagedllm.bench.server_process import ServerProcess as Server

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "80"))


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A small context and few sequences keep each fuzzed generation short."""
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    argv = ["--model", tiny_model_dir, "--dtype", "float32", "--threads", "1", "--num-blocks", "96",
            "--max-model-len", "128", "--max-num-seqs", "8", "--disable-log-requests"]
    with Server(argv, str(log), timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}) as server:
        yield server
    assert "Traceback" not in Path(log).read_text(errors="replace"), Path(log).read_text()[-3000:]


def operations() -> list[tuple[str, str, str]]:
    """(method, path, mode) of every operation in the server's schema (the app's routes, without starting it): valid
    requests for all, invalid ones for those that take a body (the others have nothing to break)."""
    from pagedllm.entrypoints.openai.app import ROUTERS

    ops = sorted((method, route.path, route.body_field is not None) for router in ROUTERS for route in router.routes
                 for method in route.methods)
    return [(m, p, mode) for m, p, body in ops for mode in ("positive", "negative") if mode == "positive" or body]


@pytest.mark.parametrize(("method", "path", "mode"), operations())
def test_no_request_gets_a_server_error(fuzz_server: Server, method: str, path: str, mode: str) -> None:
    """Hypothesis draws requests from the schema (valid ones, and ones that break it); each gets an answer < 500."""
    api = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operation = api[path][method]
    examples = max(1, EXAMPLES // 2)

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    def check(case: schemathesis.Case) -> None:
        if mode == "positive" and isinstance(case.body, dict):
            case.body.pop("model", None)  # a random model name is a 404 before anything else: reach the engine
        response = case.call(base_url=fuzz_server.url, timeout=120)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

    check()


def test_server_is_healthy_after_fuzzing(fuzz_server: Server) -> None:
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200
    r = httpx.post(f"{fuzz_server.url}/v1/completions", json={"prompt": "still here", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    metrics = httpx.get(f"{fuzz_server.url}/metrics").text
    assert 'pagedllm:kv_blocks_in_use{model_name=' in metrics
