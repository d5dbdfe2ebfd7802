"""`pagedllm bench throughput --breakdown`: where a whole workload's time went, by part of the step (the timers of
`pagedllm bench latency`) and by step size, so that on a new machine one run shows which kernels hold it (the
matmuls of prompt-sized steps, decode attention, the lm_head, Python)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from pagedllm.engine.step_timers import PARTS

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine, StepRecord


@dataclass
class SizeBucket:
    """The steps of one size class: those that computed up to `rows_up_to` rows (prompt tokens, decodes, drafts)."""

    rows_up_to: int
    steps: int = 0
    seconds: float = 0.0
    rows: int = 0


@dataclass
class Breakdown:
    """Seconds per part of PARTS (plus "other": the run's wall time minus their sum) and per step size."""

    elapsed_s: float
    parts_s: dict[str, float]
    by_rows: list[SizeBucket] = field(default_factory=list)

    def as_dict(self) -> dict:
        """Seconds to the microsecond: a part under half a millisecond (a small model's attention) is not 0."""
        return {"elapsed_s": round(self.elapsed_s, 6), "parts_s": {k: round(v, 6) for k, v in self.parts_s.items()},
                "by_rows": [asdict(b) | {"seconds": round(b.seconds, 6)} for b in self.by_rows]}


class StepSizes:
    """A step observer: each step's wall time, from the end of the step before (or `start()`), by its rows."""

    def __init__(self) -> None:
        self.buckets: dict[int, SizeBucket] = {}
        self.last = time.perf_counter()

    def start(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, record: StepRecord) -> None:
        now, rows = time.perf_counter(), record.num_batched_tokens
        bound = 1 << max(rows - 1, 0).bit_length()
        bucket = self.buckets.setdefault(bound, SizeBucket(bound))
        bucket.steps += 1
        bucket.seconds += now - self.last
        bucket.rows += rows
        self.last = now


class BreakdownRecorder:
    """Times every step run inside its `with` block by part and by size; `result` holds the Breakdown after it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.sizes, self.result = engine, StepSizes(), None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> BreakdownRecorder:
        self.engine.add_step_observer(self.sizes)
        self._stack.callback(self.engine.remove_step_observer, self.sizes)
        self.timers = self._stack.enter_context(self.engine.step_timers())
        self.start = time.perf_counter()
        self.sizes.start()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        self._stack.close()
        parts = {p: self.timers.seconds[p] for p in PARTS}
        parts["other"] = max(0.0, elapsed - sum(parts.values()))
        self.result = Breakdown(elapsed, parts, [self.sizes.buckets[k] for k in sorted(self.sizes.buckets)])


def print_breakdown(b: Breakdown) -> None:
    """Two tables: the parts of the run's time, then the steps by size."""
    total = b.elapsed_s or 1.0
    print(f"Where the time went ({b.elapsed_s:.1f} s, step timers on):")
    print("  " + "  ".join(f"{p} {s:.2f} s ({s / total:.0%})" for p, s in b.parts_s.items() if s >= 0.0005))
    print("| rows a step computed, up to | steps | s | share | ms per step | rows/s |\n|---:|---:|---:|---:|---:|---:|")
    for k in b.by_rows:
        print(f"| {k.rows_up_to} | {k.steps} | {k.seconds:.2f} | {k.seconds / total:.0%} | "
              f"{1000 * k.seconds / max(k.steps, 1):.1f} | {k.rows / k.seconds if k.seconds else 0:.0f} |")
