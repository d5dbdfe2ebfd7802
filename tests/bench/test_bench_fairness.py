"""`pagedllm bench fairness`: its measures on made-up results, and a whole run against `pagedllm serve` processes
on the tiny model (behaviour only: counts and structure, never a timing)."""

from __future__ import annotations

import asyncio
import json

from pagedllm.bench import fairness
from pagedllm.bench.client import RequestResult
from pagedllm.bench.fairness import Sent, Workload, client_rows, service_samples
from pagedllm.core.fairness import INPUT_WEIGHT, OUTPUT_WEIGHT, max_service_gap
from pagedllm.entrypoints.cli import main


def result(start: float, ttft: float, gaps: list[float], prompt_len: int = 10) -> RequestResult:
    return RequestResult(prompt_len, start_s=start, ttft_s=ttft, itl_s=gaps, output_tokens=1 + len(gaps),
                         latency_s=ttft + sum(gaps))


def test_service_trace_counts_prompt_at_first_token_and_each_output_token():
    log = [Sent("a", result(0.0, 1.0, [1.0, 1.0])), Sent("b", result(0.0, 2.5, []))]
    samples = service_samples(log, end_s=4.0, step_s=0.5)
    served, backlogged = samples[2]  # t = 1.0: a's first token is in, b still waits
    assert served == {"a": INPUT_WEIGHT * 10 + OUTPUT_WEIGHT, "b": 0.0} and backlogged == {"b"}
    assert samples[0][1] == {"a", "b"}
    assert samples[-1][0] == {"a": INPUT_WEIGHT * 10 + 3 * OUTPUT_WEIGHT, "b": INPUT_WEIGHT * 10 + OUTPUT_WEIGHT}
    # both backlogged only at t = 0 and 0.5, while neither was served: no gap
    assert max_service_gap(samples) == 0.0
    rows = client_rows(log, duration_s=4.0)
    assert [(r["client"], r["requests"], r["output_tokens"]) for r in rows] == [("a", 1, 3), ("b", 1, 1)]


def test_the_idle_run_sends_the_light_clients_other_prompts_than_the_contended_run(monkeypatch):
    """On the same server, the contended run's light prompts repeated from the idle run would hit the prefix cache."""
    prompts = []

    async def record(http, body, client, t0, log):
        prompts.append(body["prompt"])
    monkeypatch.setattr(fairness, "send", record)
    stop = asyncio.Event()
    stop.set()  # one request each
    for idle in (True, False, True):
        asyncio.run(fairness.light_client(None, "m", Workload(think_s=0.0), 0, 0.0, stop, [], idle=idle))
    assert prompts[0] != prompts[1] and prompts[0] == prompts[2]


def test_the_heavy_client_keeps_at_most_its_concurrency_in_flight(monkeypatch):
    """--heavy-concurrency 2: never more than two heavy requests in flight, all of them sent; 0 sends all at once."""
    in_flight, peak, sent = 0, 0, []

    async def record(http, body, client, t0, log):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        sent.append(body["prompt"])
        in_flight -= 1
    monkeypatch.setattr(fairness, "send", record)
    for concurrency, most in ((2, 2), (0, 5)):
        peak, sent[:] = 0, []
        w = Workload(heavy_requests=5, heavy_concurrency=concurrency, heavy_input_len=3)
        asyncio.run(fairness.heavy_client(None, "m", w, fairness.random.Random(0), 0.0, []))
        assert peak == most and len(sent) == 5 and all(len(p) == 3 for p in sent)


def test_bench_fairness_runs_every_policy(tiny_model_dir, tmp_path):
    out = tmp_path / "fairness.json"
    assert main(["bench", "fairness", "--model", tiny_model_dir, "--dtype", "float32", "--threads", "1",
                 "--attention-backend", "reference", "--num-blocks", "128", "--max-model-len", "256",
                 "--max-num-seqs", "2", "--heavy-requests", "3", "--heavy-input-len", "16", "--heavy-output-len", "4",
                 "--light-clients", "2", "--light-input-len", "8", "--light-output-len", "2", "--think-time", "0.1",
                 "--idle-seconds", "1", "--server-log-dir", str(tmp_path), "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["policy"] for r in result["runs"]] == ["idle", "fcfs", "priority", "fair"]
    assert "--scheduling-policy" not in result["server_argv"]
    for run in result["runs"]:
        clients = {row["client"]: row for row in run["clients"]}
        assert set(clients) == ({"light0", "light1"} if run["policy"] == "idle" else {"heavy", "light0", "light1"})
        assert all(row["failed"] == 0 and row["requests"] >= 1 for row in clients.values())
        if run["policy"] != "idle":
            assert clients["heavy"]["requests"] == 3 and clients["heavy"]["output_tokens"] == 12
            # the engine's own trace of the run (serve --service-trace), beside the bound: 2·max(16, 2·2·20)
            assert run["service_bound"] == 160 and run["engine_max_service_gap"] is not None
            if run["policy"] == "fair":
                assert run["engine_max_service_gap"] <= run["service_bound"]
    assert (tmp_path / "service-fair.jsonl").stat().st_size > 0
