"""`pagedllm serve --service-trace FILE`: the service each client got, step by step (the engine's ServiceLedger,
core/service.py), as JSON lines, so VTC's bound can be checked on a live server (tests/entrypoints/
test_service_trace.py, `bench fairness`). A line per step that served someone or changed who waits:
{"t": unix time, "step": n, "served": {client: its total so far, for the clients served in the step},
"backlogged": [the clients with a request waiting when the step began]}; {"restart": true} when a fresh engine
replaced a broken one (totals start again from zero). The anonymous client is "".
"""

from __future__ import annotations

import json
import time
from typing import TextIO

from pagedllm.engine.protocol import ServingObserver, SteppedEngine
from pagedllm.outputs import RequestOutput

Sample = tuple[dict[str, float], set[str]]  # core.fairness.max_service_gap's: service so far, who was backlogged


class ServiceTrace(ServingObserver):
    """Writes the ledger's new step after each engine step (the async engine's observer)."""

    def __init__(self, path: str) -> None:
        self.file: TextIO = open(path, "w", buffering=1)  # line-buffered: readable while the server runs
        self._step = 0
        self._backlogged: frozenset[str] | None = None

    def record(self, engine: SteppedEngine, outputs: list[RequestOutput]) -> None:
        ledger = engine.service
        if ledger.steps == self._step:
            return
        self._step = ledger.steps
        if not ledger.changed and ledger.backlogged == self._backlogged:
            return
        self._backlogged = ledger.backlogged
        served = {c: ledger.clients[c].service for c in ledger.changed if c in ledger.clients}
        self.file.write(json.dumps({"t": round(time.time(), 4), "step": ledger.steps, "served": served,
                                    "backlogged": sorted(ledger.backlogged)}) + "\n")

    def record_restart(self) -> None:
        self._step, self._backlogged = 0, None
        self.file.write(json.dumps({"restart": True}) + "\n")

    def close(self) -> None:
        self.file.close()


def read_service_trace(path: str, since: float = 0.0) -> list[Sample]:
    """The trace as max_service_gap's samples: every client's total after each line's step, and who waited (after a
    restart, the fresh engine's totals are added to the old ones); only the steps from unix time `since` on."""
    samples: list[Sample] = []
    served: dict[str, float] = {}
    before: dict[str, float] = {}  # the totals when the engine last restarted
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("restart"):
                before = dict(served)
                continue
            served.update({c: before.get(c, 0.0) + v for c, v in record["served"].items()})
            if record["t"] >= since:
                samples.append((dict(served), set(record["backlogged"])))
    return samples
