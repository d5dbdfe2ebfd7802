"""`pagedllm bench serve` and `bench sweep` against real `pagedllm serve` processes on the tiny model.
Only behaviour is asserted (counts, the order of the times, the metric as defined), never a timing."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedllm.bench.client import completion_payload, gauge_values, parse_metrics, run_async, run_benchmark
from pagedllm.bench.plots import plot_timelines
from pagedllm.bench.serve import servable
from pagedllm.bench.server_process import ServerProcess, engine_actions, free_port, passthrough_argv
from pagedllm.bench.summary import summarize
from pagedllm.bench.sweep import default_threshold, max_sustainable_rates
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import main

REPO = Path(__file__).resolve().parents[2]
# Small and exact: float32, one thread, the reference attention (no C++ build), a 256-token context.
TINY_SERVER_ARGS = ["--dtype", "float32", "--threads", "1", "--attention-backend", "reference", "--num-blocks", "128",
                    "--max-model-len", "256", "--disable-log-requests"]
MAX_MODEL_LEN = 256


@dataclass
class BenchRequest:
    """Stand-in for pagedllm.bench.datasets.BenchRequest (same fields), so these tests make their requests by hand."""

    prompt: str
    prompt_token_ids: list[int]
    output_len: int
    n: int = 1
    beam_width: int = 0


def make_requests(specs: list[tuple[int, int, int]], seed: int = 0) -> list[BenchRequest]:
    """(prompt_len, output_len, n) -> requests of random ordinary token ids (no special tokens)."""
    rng = random.Random(seed)
    return [BenchRequest("", [rng.randrange(1000, 49152) for _ in range(p)], out, n) for p, out, n in specs]


def server_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}  # this tree's pagedllm in the server too


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("bench-serve") / "server.log"
    with ServerProcess(["--model", tiny_model_dir, *TINY_SERVER_ARGS], str(log), timeout=120,
                       env=server_env()) as s:
        yield s
    assert "Traceback" not in log.read_text(errors="replace")


# First in the file: the server is fresh, so its running-max gauge rises during this run.
def test_run_measures_every_request_and_counts_failures(server: ServerProcess, tiny_model_dir: str,
                                                        tmp_path: Path) -> None:
    # The last two fail: a prompt longer than the context; a prompt that fits but leaves no room for its output.
    specs = [(12, 6, 1), (30, 4, 1), (8, 8, 2), (20, 5, 1), (40, 3, 1), (16, 7, 1), (300, 4, 1), (250, 10, 1)]
    requests = make_requests(specs)
    arrivals = [0.1 * i for i in range(len(requests))]  # a finite rate: 10 requests/s
    run = asyncio.run(run_benchmark(server.url, tiny_model_dir, requests, arrivals, sample_interval=0.1))
    summary = summarize(run, 10.0)

    *ok, too_long, no_room = run.results
    assert too_long.error.startswith("HTTP 400") and "max_model_len is 256" in too_long.error
    assert no_room.error.startswith("HTTP 400") and "maximum context length is 256" in no_room.error
    for result, (prompt_len, output_len, n) in zip(ok, specs[:-2], strict=True):
        assert result.error is None, result.error
        assert result.prompt_len == prompt_len and result.n == n
        assert result.output_tokens == output_len * n  # ignore_eos: every sample runs to max_tokens
        assert 0 < result.ttft_s <= result.latency_s
        assert all(gap > 0 for gap in result.itl_s)
        assert len(result.itl_s) <= (output_len - 1) * n  # at most one gap per later token of each sample
    assert any(r.itl_s for r in ok)

    assert summary["num_requests"] == 8 and summary["num_completed"] == 6 and summary["num_failed"] == 2
    assert summary["request_rate"] == 10.0 and summary["duration_s"] > 0
    assert summary["total_output_tokens"] == sum(out * n for _, out, n in specs[:-2])
    assert summary["total_input_tokens"] == sum(p for p, _, _ in specs[:-2])
    expected = sum(r.latency_s / r.output_tokens for r in ok) / len(ok)
    assert summary["normalized_latency_s_per_token"] == pytest.approx(expected, rel=1e-4, abs=5e-7)  # 6 decimals
    assert summary["requests_per_s"] == pytest.approx(6 / run.duration_s, rel=1e-3)
    assert summary["output_tokens_per_s"] == pytest.approx(summary["total_output_tokens"] / run.duration_s, rel=1e-3)
    for name in ("ttft", "itl", "e2e"):
        assert 0 < summary[f"median_{name}_s"] <= summary[f"p99_{name}_s"]
        assert summary[f"mean_{name}_s"] > 0
    assert summary["mean_ttft_s"] <= summary["mean_e2e_s"]
    assert summary["errors"] == sorted([too_long.error, no_room.error])
    assert [r["error"] is None for r in summary["requests"]] == [True] * 6 + [False] * 2

    # The server's own figures, scraped from /metrics.
    assert summary["peak_num_running"] >= 1
    assert summary["num_preemptions"] == 0  # 128 blocks hold every request at once
    assert summary["kv_waste_fraction"] is None or 0 <= summary["kv_waste_fraction"] <= 1
    assert 0 <= summary["mean_kv_cache_usage"] <= summary["peak_kv_cache_usage"] <= 1
    times = [s["t_s"] for s in run.timeline]
    assert times and times == sorted(times)
    json.dumps(summary, allow_nan=False)

    png = tmp_path / "timeline.png"
    plot_timelines([("rate 10", {"": run.timeline})], str(png))
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("path", ["", "/", "/behind/a/proxy"])
def test_unreachable_server_counts_every_request_as_failed(path: str) -> None:
    url = f"http://127.0.0.1:{free_port()}{path}"  # nothing listens there; a path prefix is a URL like any other
    run = asyncio.run(run_benchmark(url, "m", make_requests([(5, 2, 1)] * 3), [0.0] * 3, sample_interval=0.05))
    summary = summarize(run, math.inf)
    assert summary["num_failed"] == 3 and summary["num_completed"] == 0
    assert all("ClientConnectorError" in r.error for r in run.results)
    assert summary["request_rate"] == "inf" and summary["normalized_latency_s_per_token"] is None
    assert summary["mean_ttft_s"] is None and summary["peak_num_running"] is None and run.timeline == []
    json.dumps(summary, allow_nan=False)


def test_gauge_values_read_the_same_samples_as_the_full_parser() -> None:
    """The timeline's quick read of /metrics agrees with prometheus_client's parser, labels, histograms and all."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    Gauge("pagedllm:num_requests_running", "running", registry=registry).set(7)
    waiting = Gauge("pagedllm:num_requests_waiting", "waiting", ["client"], registry=registry)
    waiting.labels("a").set(2)
    waiting.labels('b{"},').set(3.5)  # a label value with the characters that end a label set
    Counter("pagedllm:generation_tokens", "tokens", ["model"], registry=registry).labels("m").inc(1e9 + 0.25)
    Histogram("pagedllm:e2e_request_latency_seconds", "e2e", registry=registry).observe(0.3)
    text = generate_latest(registry).decode()
    full = parse_metrics(text)
    assert full["pagedllm:num_requests_waiting"] == 5.5 and full["pagedllm:num_requests_running"] == 7
    assert gauge_values(text, set(full)) == full
    assert gauge_values(text, {"pagedllm:num_requests_running", "absent"}) == {"pagedllm:num_requests_running": 7}


def test_run_async_returns_the_coroutines_result() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert run_async(answer()) == 42


def test_beam_search_requests_are_skipped(capsys: pytest.CaptureFixture) -> None:
    plain, beam = make_requests([(5, 2, 1), (5, 2, 1)])
    beam.beam_width = 4
    assert servable([plain, beam]) == [plain]
    assert "skipping 1 beam-search request" in capsys.readouterr().err
    with pytest.raises(ValueError, match="beam search"):
        servable([beam])


def test_engine_flags_pass_through_to_the_server() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--model", "m", "--num-blocks", "64", "--no-enable-prefix-caching", "--threads", "1"])
    assert passthrough_argv(args, engine_actions()) == [
        "--model", "m", "--num-blocks", "64", "--threads", "1", "--no-enable-prefix-caching"]
    assert passthrough_argv(parser.parse_args([]), engine_actions()) == []


def test_max_sustainable_rate_is_the_last_rate_under_the_threshold() -> None:
    def point(policy: str, rate: float | str, latency: float | None, failed: int = 0) -> dict:
        return {"kv_policy": policy, "request_rate": rate, "normalized_latency_s_per_token": latency,
                "num_failed": failed}

    points = [point("paged", 1.0, 0.1), point("paged", 2.0, 0.2), point("paged", 4.0, 0.6), point("paged", 8.0, 0.3),
              point("max", 1.0, 0.3), point("max", 2.0, 0.45, failed=1), point("none", 1.0, 0.9),
              point("inf", 2.0, 0.1), point("inf", "inf", 0.2)]
    policies = ["paged", "max", "none", "inf"]
    assert default_threshold(points, policies, 5.0) == pytest.approx(0.5)
    # paged stops at 4 req/s although 8 req/s is under again; a failed request makes a rate unsustainable.
    assert max_sustainable_rates(points, policies, 0.5) == {"paged": 2.0, "max": 1.0, "none": None, "inf": "inf"}


def test_sweep_command_launches_a_server_per_policy(tiny_model_dir: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pagedllm.bench.datasets")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # this tree's pagedllm in the launched server too
    out, png = tmp_path / "sweep.json", tmp_path / "fig12.png"
    engine = ["--model", tiny_model_dir, *TINY_SERVER_ARGS[:-1]]
    port = free_port()
    assert main(["bench", "sweep", "--request-rates", "4,inf", "--kv-policies", "paged", "--dataset", "random",
                 "--port", str(port), "--num-prompts", "3", "--input-len", "12", "--output-len", "4",
                 "--metrics-interval", "0.2", "--temperature", "0.8",
                 "--server-log-dir", str(tmp_path), "--output-json", str(out), "--plot", str(png), *engine]) == 0
    result = json.loads(out.read_text())
    assert result["policies"] == ["paged"] and result["request_rates"] == [4.0, "inf"]
    assert result["sampling"] == {"temperature": 0.8}  # every request sampled; the server was given no such flag
    assert "--temperature" not in result["server_argv"]
    passed = result["server_argv"][:len(engine)]  # every engine flag given (all take a value here), passed through
    assert dict(zip(passed[::2], passed[1::2])) == dict(zip(engine[::2], engine[1::2]))
    assert [(p["kv_policy"], p["request_rate"]) for p in result["points"]] == [("paged", 4.0), ("paged", "inf")]
    for p in result["points"]:
        assert p["num_completed"] == 3 and p["num_failed"] == 0 and p["total_output_tokens"] == 12
        assert p["normalized_latency_s_per_token"] > 0 and p["timeline"]
    lowest = result["points"][0]["normalized_latency_s_per_token"]
    assert result["latency_threshold_s_per_token"] == pytest.approx(5 * lowest)
    assert result["max_sustainable_rate"]["paged"] in (4.0, "inf")
    assert (tmp_path / "server-paged.log").exists()
    assert result["server_port"] == port and ServerProcess([], "", port=port).url == f"http://127.0.0.1:{port}"
    assert png.read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "fig12-timeline.png").read_bytes().startswith(b"\x89PNG")


def test_bench_serve_command(server: ServerProcess, tiny_model_dir: str, tmp_path: Path) -> None:
    pytest.importorskip("pagedllm.bench.datasets")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert main(["bench", "serve", "--base-url", server.url, "--dataset", "random", "--num-prompts", "4",
                 "--input-len", "16", "--output-len", "4", "--request-rate", "20", "--metrics-interval", "0.1",
                 "--output-json", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == tiny_model_dir  # the server's first model; its folder gave the tokenizer
    assert result["num_completed"] == 4 and result["num_failed"] == 0
    assert result["total_input_tokens"] == 4 * 16 and result["total_output_tokens"] == 4 * 4
    assert result["dataset"] == "random" and result["request_rate"] == 20.0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert result["sampling"] == {}
    # sampled: every request's body carries the flags; the server samples them all to their exact lengths
    assert main(["bench", "serve", "--base-url", server.url, "--dataset", "random", "--num-prompts", "4",
                 "--input-len", "16", "--output-len", "4", "--top-p", "0.9", "--top-k", "20",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["sampling"] == {"top_p": 0.9, "top_k": 20, "temperature": 1.0}
    assert result["num_completed"] == 4 and result["num_failed"] == 0 and result["total_output_tokens"] == 4 * 4


def test_a_request_body_carries_the_sampling_flags() -> None:
    request = SimpleNamespace(prompt_token_ids=[1, 2], output_len=3, n=1)
    assert completion_payload("m", request)["temperature"] == 0.0
    body = completion_payload("m", request, {"temperature": 0.8, "top_p": 0.95})
    assert (body["temperature"], body["top_p"], body["ignore_eos"], body["max_tokens"]) == (0.8, 0.95, True, 3)


def test_client_tokenizer_comes_without_the_weights(tiny_model_dir: str, tiny_gguf_path: str) -> None:
    from pagedllm.model.loader import load_tokenizer
    from pagedllm.model.tokenizer import Tokenizer

    text = "The benchmark's prompts are token ids."
    expected = Tokenizer.from_dir(tiny_model_dir).encode(text)
    assert load_tokenizer(tiny_model_dir).encode(text) == load_tokenizer(tiny_gguf_path).encode(text) == expected
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(Path(tiny_model_dir) / "missing"))
