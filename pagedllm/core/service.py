"""What each client has been served, measured from the engine's steps under every policy (not VTC's counters, which
lift a returning client): the quantity VTC's bound is about, the dashboard's per-client table, and the samples a
service trace records to check the bound on a live server."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.core.fairness import INPUT_WEIGHT, OUTPUT_WEIGHT
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.sequence import SequenceGroup

ANONYMOUS = ""  # the client of requests that name none
KEPT_CLIENTS = 4096  # past this, the entries of clients with nothing waiting are dropped


def client_name(client: str | None) -> str:
    return ANONYMOUS if client is None else client


@dataclass
class ClientService:
    """One client's share of the work so far: requests started, tokens, time waited, weighted service."""

    requests: int = 0  # requests scheduled for the first time
    prompt_tokens: int = 0
    output_tokens: int = 0
    queue_time_s: float = 0.0  # summed over its requests: arrival to first scheduled
    service: float = 0.0  # w_p per prompt token (once, at first scheduling) + w_q per generated token

    def as_dict(self, name: str) -> dict[str, float | int | str]:
        return {"client": name, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "queue_time_s": round(self.queue_time_s, 3),
                "service": self.service}


class ServiceLedger:
    """Per client, what the engine's steps served. The engine calls `start_step` with the waiting requests before
    it schedules (VTC's "backlogged" clients) and the plan before first-scheduled times are stamped, `end_step`
    once the step's tokens are accepted."""

    def __init__(self) -> None:
        self.clients: dict[str, ClientService] = {}
        self.backlogged: frozenset[str] = frozenset()  # clients with a request waiting when the last step began
        self.changed: set[str] = set()  # clients served in the last step
        self.steps = 0

    def note_waiting(self, waiting: Iterable[SequenceGroup]) -> None:
        self.backlogged = frozenset(client_name(g.client) for g in waiting)

    def start_step(self, plan: SchedulerOutput, now: float) -> None:
        """Charge the prompts of requests scheduled for the first time (their first_scheduled_time still unset)."""
        self.changed = set()
        for s in plan.scheduled:
            m = s.seq.metrics
            if m.first_scheduled_time is None:
                entry = self._entry(s.seq.params.client)
                entry.requests += 1
                entry.prompt_tokens += s.seq.num_prompt_tokens
                entry.queue_time_s += max(0.0, now - m.arrival_time)
                entry.service += INPUT_WEIGHT * s.seq.num_prompt_tokens

    def end_step(self, plan: SchedulerOutput) -> None:
        """Charge the tokens sampled (a speculative decode's accepted ones: its draft is cut to them by now)."""
        for s in plan.scheduled:
            if s.samplers:
                tokens = len(s.samplers) * (1 + len(s.draft))
                entry = self._entry(s.seq.params.client)
                entry.output_tokens += tokens
                entry.service += OUTPUT_WEIGHT * tokens
        self.steps += 1
        if len(self.clients) > KEPT_CLIENTS:
            self.clients = {c: e for c, e in self.clients.items() if c in self.backlogged or c in self.changed}

    def _entry(self, client: str | None) -> ClientService:
        name = client_name(client)
        self.changed.add(name)
        entry = self.clients.get(name)
        if entry is None:
            entry = self.clients[name] = ClientService()
        return entry

    def served(self) -> dict[str, float]:
        return {c: e.service for c, e in self.clients.items()}

    def table(self, limit: int = 32) -> list[dict[str, float | int | str]]:
        """The clients served most, most first (the dashboard's per-client table)."""
        top = sorted(self.clients.items(), key=lambda kv: -kv[1].service)[:limit]
        return [entry.as_dict(name) for name, entry in top]


def service_bound(max_input_len: int, kv_tokens: int) -> float:
    """Sheng et al.'s bound on the service difference of two backlogged clients: 2·max(w_p·L_input, w_q·M), with M
    the tokens the KV cache holds."""
    return 2 * max(INPUT_WEIGHT * max_input_len, OUTPUT_WEIGHT * kv_tokens)
