"""Per-client and per-priority metrics: each request counted under its client and priority, with label sets that a
flood of client names or priorities cannot grow."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from pagedllm.core.kv_stats import EngineCounters
from pagedllm.entrypoints.openai.client_metrics import (
    ANONYMOUS_LABEL,
    MAX_CLIENT_LABELS,
    OTHER_LABEL,
    ClientLabels,
    priority_label,
)
from pagedllm.entrypoints.openai.metrics import EngineStats
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

IDLE = SimpleNamespace(num_running=0, num_waiting=0, stats=lambda: EngineCounters(*[0] * 4, 16, *[0] * 8))


def output(rid: str, client: str | None, priority: int, tokens: int, finished: bool) -> RequestOutput:
    m = RequestMetrics(100.0, first_scheduled_time=100.5, first_token_time=101.0, client=client, priority=priority)
    done = "length" if finished else None
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, "x", list(range(tokens)), None, None, done)],
                         finished, m)


def value(stats: EngineStats, name: str, **labels: str) -> float:
    return stats.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_requests_tokens_and_queue_time_per_client_and_priority():
    stats = EngineStats("m", named_clients=["batch"])
    stats.record(IDLE, [output("a", "alice", 0, 1, False), output("b", None, 5, 2, False)])
    stats.record(IDLE, [output("a", "alice", 0, 4, True), output("b", None, 5, 2, True)])
    assert value(stats, "pagedllm:client_requests_total", client="alice") == 1
    assert value(stats, "pagedllm:client_prompt_tokens_total", client="alice") == 3
    assert value(stats, "pagedllm:client_generation_tokens_total", client="alice") == 4
    assert value(stats, "pagedllm:client_generation_tokens_total", client=ANONYMOUS_LABEL) == 2
    assert value(stats, "pagedllm:priority_generation_tokens_total", priority="5") == 2
    assert value(stats, "pagedllm:priority_requests_total", priority="0") == 1
    assert value(stats, "pagedllm:client_request_queue_time_seconds_count", client="alice") == 1
    assert value(stats, "pagedllm:client_request_queue_time_seconds_sum", client="alice") == 0.5
    assert b'client="batch"' not in generate_latest(stats.registry)  # named, but nothing served yet


def test_label_sets_are_bounded():
    labels = ClientLabels(named=["vip"], limit=3)
    assert [labels(f"u{i}") for i in range(5)] == ["u0", "u1", "u2", OTHER_LABEL, OTHER_LABEL]
    assert labels("u1") == "u1" and labels("vip") == "vip" and labels(None) == ANONYMOUS_LABEL
    assert {priority_label(p) for p in range(-1000, 1000)} == {str(p) for p in range(-10, 11)} | {"<-10", ">10"}
    stats = EngineStats("m")
    stats.record(IDLE, [output(f"r{i}", f"user{i}", i, 1, True) for i in range(200)])
    text = generate_latest(stats.registry).decode()
    clients = {line.split('client="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("pagedllm:client_requests_total")}
    assert len(clients) == MAX_CLIENT_LABELS + 1 and OTHER_LABEL in clients
    assert value(stats, "pagedllm:client_requests_total", client=OTHER_LABEL) == 200 - MAX_CLIENT_LABELS
    assert value(stats, "pagedllm:priority_requests_total", priority=">10") == 200 - 11
