"""Serving metrics per client and per priority (who is served, and how long each waits): finished requests, prompt
and generated tokens, and queue time, in two sets of series, `pagedllm:client_*` labelled `client` and
`pagedllm:priority_*` labelled `priority`.

The label sets are bounded, so a flood of `user` values or priorities cannot grow /metrics: a client keeps its own
label if --client-weights names it or it is one of the first MAX_CLIENT_LABELS other clients seen; every later one is
counted as "(other)". Priorities in [-PRIORITY_LABELS, PRIORITY_LABELS] keep their value, the others share "<-10" or
">10". A request keeps the labels it got when first seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

MAX_CLIENT_LABELS = 16
PRIORITY_LABELS = 10
ANONYMOUS_LABEL = "(anonymous)"  # requests that name no client
OTHER_LABEL = "(other)"  # clients past the bound


@dataclass(frozen=True)
class RequestLabels:
    client: str
    priority: str


def priority_label(priority: int) -> str:
    if priority < -PRIORITY_LABELS:
        return f"<-{PRIORITY_LABELS}"
    return f">{PRIORITY_LABELS}" if priority > PRIORITY_LABELS else str(priority)


class ClientLabels:
    """A client's label: its name if named in the weights file or among the first `limit` others, else (other)."""

    def __init__(self, named: Iterable[str] = (), limit: int = MAX_CLIENT_LABELS) -> None:
        self.named = frozenset(named)
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, client: str | None) -> str:
        if client is None or client == "":
            return ANONYMOUS_LABEL
        if client in self.named or client in self.seen:
            return client
        if len(self.seen) < self.limit:
            self.seen.add(client)
            return client
        return OTHER_LABEL


class ClientMetrics:
    """The per-client and per-priority series of one server's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str, buckets: list[float],
                 named_clients: Iterable[str] = ()) -> None:
        self.model_name = model_name
        self.client_label = ClientLabels(named_clients)
        # each by "client" and by "priority"
        self.requests: dict[str, Counter] = {}
        self.prompt_tokens: dict[str, Counter] = {}
        self.generation_tokens: dict[str, Counter] = {}
        self.queue_time: dict[str, Histogram] = {}
        for by in ("client", "priority"):
            labels = ["model_name", by]
            self.requests[by] = Counter(f"pagedllm:{by}_requests", f"Finished requests, by {by}.", labels,
                                        registry=registry)
            self.prompt_tokens[by] = Counter(f"pagedllm:{by}_prompt_tokens", f"Prefill tokens processed, by {by}.",
                                             labels, registry=registry)
            self.generation_tokens[by] = Counter(f"pagedllm:{by}_generation_tokens", f"Tokens generated, by {by}.",
                                                 labels, registry=registry)
            self.queue_time[by] = Histogram(f"pagedllm:{by}_request_queue_time_seconds",
                                            f"Arrival to first scheduled, by {by}.", labels, buckets=buckets,
                                            registry=registry)

    def labels_of(self, client: str | None, priority: int) -> RequestLabels:
        return RequestLabels(self.client_label(client), priority_label(priority))

    def _each(self, family: dict[str, Counter] | dict[str, Histogram], labels: RequestLabels) -> list[Any]:
        """The request's series of a family: its client's and its priority's."""
        return [family["client"].labels(self.model_name, labels.client),
                family["priority"].labels(self.model_name, labels.priority)]

    def record_first_token(self, labels: RequestLabels, prompt_tokens: int, queue_time: float | None) -> None:
        for series in self._each(self.prompt_tokens, labels):
            series.inc(prompt_tokens)
        if queue_time is not None:
            for series in self._each(self.queue_time, labels):
                series.observe(queue_time)

    def record_tokens(self, labels: RequestLabels, generated: int) -> None:
        for series in self._each(self.generation_tokens, labels):
            series.inc(generated)

    def record_finished(self, labels: RequestLabels) -> None:
        for series in self._each(self.requests, labels):
            series.inc()
