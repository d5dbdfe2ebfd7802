"""Serving metrics: Prometheus series named like vLLM's (`pagedllm:` for `vllm:`), and vLLM-style log lines.

`EngineStats.record` is called by the async engine's loop thread after every step (and after aborts), so it
sees each request's outputs in order and the engine's state between steps; Prometheus reads from another
thread, which prometheus-client allows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.protocol import ReplicaSetClient, ServingObserver, SteppedEngine
from pagedllm.entrypoints.openai.client_metrics import ClientMetrics, RequestLabels
from pagedllm.outputs import RequestOutput

request_logger = logging.getLogger("pagedllm.requests")
stats_logger = logging.getLogger("pagedllm.stats")

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0]
# The second tier's counters in engine.stats().kv_tier -> /metrics counters pagedllm:kv_tier_<name>_total.
KV_TIER_COUNTERS = {
    "hits": "KV blocks of new prompts restored from the second tier (--kv-offload-dir) instead of computed.",
    "misses": "KV blocks of new prompts found in neither the prefix cache nor the second tier.",
    "bytes_read": "Bytes read from the second tier's files.",
    "bytes_written": "Bytes written to the second tier's files.",
    "restore_seconds": "Time spent restoring KV blocks from the second tier (reads and copies into the pool).",
    "writes_dropped": "KV blocks not saved to the second tier: its write queue was full or it could not write.",
    "read_errors": "Second-tier files ignored when read: gone, truncated, corrupt or another model's.",
}
# The API a request came through, by the prefix of its id (serving_*.py's `submit(ctx, prefix, ...)`).
ENDPOINTS = {"cmpl": "/v1/completions", "chatcmpl": "/v1/chat/completions", "resp": "/v1/responses",
             "msg": "/v1/messages"}
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 40.0, 80.0]


@dataclass
class _Progress:
    """What the stats have seen of one request so far."""

    labels: RequestLabels
    num_tokens: int = 0
    last_token_time: float | None = None


class EngineStats(ServingObserver):
    """Prometheus metrics for one server (its own registry) plus per-request and periodic engine log lines."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, log_interval: float = 5.0,
                 named_clients: Iterable[str] = ()) -> None:
        self.registry = registry or CollectorRegistry()
        self.log_interval = log_interval
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"pagedllm:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_running_max = gauge(
            "num_requests_running_max", "Most requests running in one step since the server started.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage: 1 = all blocks taken.")
        self.kv_waste_fraction = gauge(  # EngineCounters.last_step_kv_waste_fraction; stats() also has the run's
            "kv_waste_fraction", "Share of the KV token slots held by running requests that hold no token (last step).")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (recompute).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens verified (speculation).")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.engine_restarts = counter("engine_restarts", "Engines replaced after a failure they could not survive.")
        self.kv_blocks_in_use = gauge("kv_blocks_in_use", "KV blocks held by requests.")
        self.kv_blocks_cached_free = gauge(
            "kv_blocks_cached_free", "Free KV blocks that still hold a cached prefix (reusable until evicted).")
        self.kv_tier = {name: counter(f"kv_tier_{name}", doc) for name, doc in KV_TIER_COUNTERS.items()}
        self.kv_tier_stored_bytes = gauge("kv_tier_stored_bytes", "Bytes in the second tier's directory.")
        self._request_success = Counter("pagedllm:request_success", "Finished requests, by finish reason.",
                                        ["model_name", "finished_reason"], registry=self.registry)
        self._endpoint_requests = Counter("pagedllm:endpoint_requests", "Finished requests, by the API they came "
                                          "through.", ["model_name", "endpoint"], registry=self.registry)
        self._model_name = model_name
        self.lora = LoRAMetrics(self.registry, model_name, gauge)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.",
                                             LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between output tokens.",
                                             ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                                             LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                            LATENCY_BUCKETS)
        # the same per client and per priority (named_clients: those of --client-weights, always labelled)
        self.by_client = ClientMetrics(self.registry, model_name, LATENCY_BUCKETS, named_clients)
        self._progress: dict[str, _Progress] = {}
        self._seen_preemptions = 0
        self._seen_prefix_cache = (0, 0)  # the scheduler's (queries, hits) token counts at the last record
        self._seen_spec = (0, 0)  # the engine's (draft, accepted) token counts at the last record
        self._seen_tier: dict[str, float] = {}  # the engine's kv_tier counters at the last record
        self._peak_running = 0
        self._idle = True
        self._start_interval(time.monotonic())

    # ---- called by the loop thread ----------------------------------------------------------------------
    def record(self, engine: SteppedEngine, outputs: list[RequestOutput]) -> None:
        """Update gauges from the engine's state and counters/histograms from this step's outputs."""
        now = time.time()
        running, waiting = engine.num_running, engine.num_waiting
        if self._idle and (running or waiting or outputs):  # work after idleness opens a new log window
            self._start_interval(time.monotonic())
        self._idle = not (running or waiting)
        for out in outputs:
            self._record_output(out, now)
        self._peak_running = max(self._peak_running, running)
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.num_requests_running_max.set(self._peak_running)
        stats = engine.stats()
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.kv_blocks_in_use.set(getattr(stats, "blocks_in_use", 0))
        self.kv_blocks_cached_free.set(getattr(stats, "blocks_cached_free", 0))
        if stats.kv_slots_held:
            self.kv_waste_fraction.set(stats.last_step_kv_waste_fraction)
        if stats.preemptions > self._seen_preemptions:
            self.num_preemptions.inc(stats.preemptions - self._seen_preemptions)
            self._seen_preemptions = stats.preemptions
        self.lora.record_engine(engine, stats)
        self._record_prefix_cache_delta(stats.prefix_cache_queries, stats.prefix_cache_hits)
        self._record_spec_delta(getattr(stats, "spec_draft_tokens", 0), getattr(stats, "spec_accepted_tokens", 0))
        self._record_kv_tier(getattr(stats, "kv_tier", None) or {})
        self._maybe_log_engine(stats.kv_cache_usage, running, waiting)

    def record_restart(self) -> None:
        """A fresh engine replaced a broken one: count it; its counters start from zero, its requests are gone."""
        self.engine_restarts.inc()
        self._progress.clear()
        self._seen_preemptions = 0
        self._seen_prefix_cache = (0, 0)
        self._seen_spec = (0, 0)
        self._seen_tier = {}

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        """Hook for automatic prefix caching (issue 3): each step's looked-up and hit token counts."""
        self.prefix_cache_queries.inc(queries)
        self.prefix_cache_hits.inc(hits)

    def _record_prefix_cache_delta(self, queries: int, hits: int) -> None:
        seen_queries, seen_hits = self._seen_prefix_cache
        if queries > seen_queries:
            self.record_prefix_cache(queries - seen_queries, hits - seen_hits)
            self._seen_prefix_cache = (queries, hits)

    def _record_spec_delta(self, draft: int, accepted: int) -> None:
        seen_draft, seen_accepted = self._seen_spec
        if draft > seen_draft:
            self.spec_draft_tokens.inc(draft - seen_draft)
            self.spec_accepted_tokens.inc(accepted - seen_accepted)
            self._seen_spec = (draft, accepted)

    def _record_kv_tier(self, tier: dict[str, float]) -> None:
        for name, counter in self.kv_tier.items():
            value = tier.get(name, 0)
            if value > self._seen_tier.get(name, 0):
                counter.inc(value - self._seen_tier.get(name, 0))
                self._seen_tier[name] = value
        if "stored_bytes" in tier:
            self.kv_tier_stored_bytes.set(tier["stored_bytes"])

    def _record_output(self, out: RequestOutput, now: float) -> None:
        progress = self._progress.get(out.request_id)
        if progress is None:
            progress = self._progress[out.request_id] = _Progress(self._labels_of(out))
        num_tokens = sum(len(c.token_ids) for c in out.outputs)  # all n samples of the request
        new_tokens = num_tokens - progress.num_tokens
        m = out.metrics
        if new_tokens > 0:
            if progress.num_tokens == 0:
                self._record_first_token(out, now, progress.labels)
            elif progress.last_token_time is not None:
                self.inter_token_latency.observe((now - progress.last_token_time) / new_tokens)
            self.generation_tokens.inc(new_tokens)
            self.by_client.record_tokens(progress.labels, new_tokens)
            self.lora.record_tokens(out, new_tokens)
            self._interval_generation_tokens += new_tokens
            progress.num_tokens, progress.last_token_time = num_tokens, now
        if out.finished:
            del self._progress[out.request_id]
            reason = (out.outputs[0].finish_reason if out.outputs else None) or "abort"
            self._request_success.labels(self._model_name, reason).inc()
            self._endpoint_requests.labels(self._model_name, endpoint_of(out.request_id)).inc()
            self.by_client.record_finished(progress.labels)
            self.lora.record_request(out)
            if m is not None:
                self.e2e_request_latency.observe((m.finished_time or now) - m.arrival_time)
            log_finished_request(out, now)

    def _labels_of(self, out: RequestOutput) -> RequestLabels:
        m = out.metrics
        return self.by_client.labels_of(m.client if m else None, m.priority if m else 0)

    def _record_first_token(self, out: RequestOutput, now: float, labels: RequestLabels) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self._interval_prompt_tokens += len(out.prompt_token_ids)
        m = out.metrics
        queue_time = None if m is None or m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time
        self.by_client.record_first_token(labels, len(out.prompt_token_ids), queue_time)
        if m is None:
            return
        self.time_to_first_token.observe((m.first_token_time or now) - m.arrival_time)
        if queue_time is not None:
            self.request_queue_time.observe(queue_time)

    def _maybe_log_engine(self, kv_usage: float, running: int, waiting: int) -> None:
        """Every log_interval seconds while there is work: throughput and occupancy, as vLLM logs them.
        """
        now = time.monotonic()
        elapsed = now - self._interval_start
        if elapsed < self.log_interval:
            return
        if not self._idle or self._interval_prompt_tokens or self._interval_generation_tokens:
            stats_logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                self._interval_prompt_tokens / elapsed, self._interval_generation_tokens / elapsed,
                running, waiting, 100 * kv_usage)
        self._start_interval(now)

    def _start_interval(self, now: float) -> None:
        self._interval_start = now
        self._interval_prompt_tokens = self._interval_generation_tokens = 0


class LoRAMetrics:
    """Per LoRA adapter: finished requests and generated tokens, labelled by adapter name only while the adapter is
    loaded (an unloaded one's series go, so the label set stays as small as the loaded adapters); and gauges of
    loaded and resident adapters and the pool blocks their weights hold."""

    def __init__(self, registry: CollectorRegistry, model_name: str, gauge: Callable[[str, str], Any]) -> None:
        labels = ["model_name", "lora_name"]
        self.requests = Counter("pagedllm:lora_requests", "Finished requests per LoRA adapter.", labels,
                                registry=registry)
        self.tokens = Counter("pagedllm:lora_generation_tokens", "Tokens generated per LoRA adapter.", labels,
                              registry=registry)
        self.loaded = gauge("lora_adapters_loaded", "LoRA adapters loaded (their weights read and checked).")
        self.resident = gauge("lora_adapters_resident", "LoRA adapters resident: a slot, and blocks of the KV pool.")
        self.blocks = gauge("lora_adapter_blocks", "KV pool blocks the resident LoRA adapters' weights hold.")
        self.model_name = model_name
        self.names: set[str] = set()  # adapters with series

    def record_tokens(self, out: RequestOutput, new_tokens: int) -> None:
        if out.lora_request is not None:
            self.names.add(out.lora_request.lora_name)
            self.tokens.labels(self.model_name, out.lora_request.lora_name).inc(new_tokens)

    def record_request(self, out: RequestOutput) -> None:
        if out.lora_request is not None:
            self.names.add(out.lora_request.lora_name)
            self.requests.labels(self.model_name, out.lora_request.lora_name).inc()

    def record_engine(self, engine: SteppedEngine, stats: Any) -> None:
        """The gauges, and the series of adapters unloaded since dropped."""
        self.loaded.set(getattr(stats, "lora_adapters_loaded", 0))
        self.resident.set(getattr(stats, "lora_adapters_resident", 0))
        self.blocks.set(getattr(stats, "lora_adapter_blocks", 0))
        loaded = {r.lora_name for r in getattr(engine, "loras", {}).values()}
        for name in self.names - loaded:
            for counter in (self.requests, self.tokens):
                try:
                    counter.remove(self.model_name, name)
                except KeyError:
                    pass
        self.names &= loaded


def endpoint_of(request_id: str) -> str:
    return ENDPOINTS.get(request_id.split("-", 1)[0], "other")


def log_finished_request(out: RequestOutput, now: float) -> None:
    completion = out.outputs[0] if out.outputs else None
    m = out.metrics
    ttft = f"{m.first_token_time - m.arrival_time:.3f}s" if m and m.first_token_time else "-"
    total = f"{(m.finished_time or now) - m.arrival_time:.3f}s" if m else "-"
    request_logger.info("Finished request %s: prompt_tokens=%d output_tokens=%d ttft=%s total=%s "
                        "finish_reason=%s", out.request_id, len(out.prompt_token_ids),
                        len(completion.token_ids) if completion else 0, ttft, total,
                        (completion.finish_reason if completion else None) or "abort")


class ReplicaSetStats:
    """/metrics of a server over several replicas (`--data-parallel-size`): every replica's own series, labelled
    replica="i" (as its last health check reported them), plus the router's (requests routed per replica, affinity
    hits, re-routes, replica health)."""

    def __init__(self, pool: ReplicaSetClient, model_name: str) -> None:
        self.pool = pool
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in self.pool.replica_metrics():
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for s in family.samples:
                    labels = {**s.labels, "replica": str(replica)}
                    if "model_name" in labels:  # the server's name for the model, whatever the replica called it
                        labels["model_name"] = self.model_name
                    merged.add_sample(s.name, labels, s.value, s.timestamp)
        return [*families.values(), *self._router_families()]

    def _router_families(self) -> list[Metric]:
        router, labels = self.pool.router, ["model_name", "replica"]
        routed = CounterMetricFamily("pagedllm:router_requests", "Requests routed to each replica.", labels=labels)
        in_flight = GaugeMetricFamily("pagedllm:router_requests_in_flight", "Requests routed, not finished.",
                                      labels=labels)
        healthy = GaugeMetricFamily("pagedllm:replica_healthy", "1 if the router sends requests to the replica.",
                                    labels=labels)
        for i, load in enumerate(router.replicas):
            routed.add_metric([self.model_name, str(i)], load.routed)
            in_flight.add_metric([self.model_name, str(i)], load.in_flight)
            healthy.add_metric([self.model_name, str(i)], float(load.healthy))
        hits = CounterMetricFamily("pagedllm:router_affinity_hits",
                                   "Requests sent to a replica predicted to hold a prefix of their prompt.",
                                   labels=["model_name"])
        hits.add_metric([self.model_name], router.affinity_hits)
        rerouted = CounterMetricFamily("pagedllm:router_reroutes",
                                       "Requests routed again after their replica failed before their first output.",
                                       labels=["model_name"])
        rerouted.add_metric([self.model_name], router.rerouted)
        return [routed, in_flight, healthy, hits, rerouted]
