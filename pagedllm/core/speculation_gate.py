"""Whether a decode step verifies drafts, measured where the engine runs: the batch size from which drafts stop paying
depends on the CPU, the load on it, the model and how often drafts hold, so no constant is right everywhere.

Per bucket of running sequences (powers of two) the gate compares the tokens per second of adjacent pure decode
steps, one with drafts and one without, so that both saw nearly the same sequences and contexts; it plays the better
choice by the median of the last comparisons, and the other now and then (every EXPLORE_EVERY steps) so drift
(acceptance, load, context lengths) shows. An explicit limit (vLLM's `speculative_disable_by_batch_size`) replaces
all of this.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_PAIRS = 3  # comparisons a bucket needs before it trusts its median; until then it alternates
PAIRS_KEPT = 9  # the median is over this many latest comparisons
EXPLORE_EVERY = 32  # steps in a bucket between visits to the choice behind
# A visit is one step without drafts (compared with both neighbours), or two with: the first step with drafts after
# several without also catches every lookup up on the tokens since, so only the second is compared.


@dataclass
class Bucket:
    """One range of running sequences: log(rate with drafts / rate without) of adjacent steps, and steps decided."""

    log_ratios: deque[float] = field(default_factory=lambda: deque(maxlen=PAIRS_KEPT))
    steps: int = 0

    @property
    def settled(self) -> bool:
        return len(self.log_ratios) >= MIN_PAIRS

    @property
    def drafts_pay(self) -> bool:
        return statistics.median(self.log_ratios) > 0 if self.log_ratios else True


@dataclass
class Played:
    """The last compared step: its bucket, whether it had drafts and its tokens per second."""

    bucket: int
    drafts: bool
    rate: float


class SpeculationGate:
    """`choose(running)` before a step's drafts are made; `record(...)` with what that step gave."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # speculate while at most this many run; None: measured
        self.buckets: dict[int, Bucket] = {}
        self._pending: tuple[int, bool] | None = None  # (bucket, drafts) of the step being run
        self._last: Played | None = None
        self._without_run = 0  # steps since the last one with drafts: a lookup catches up that many tokens

    @staticmethod
    def bucket_of(running: int) -> int:
        return running.bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def choose(self, running: int) -> bool:
        """Whether this step makes drafts, with `running` sequences and nothing waiting."""
        if self.limit is not None:
            return running <= self.limit
        index = self.bucket_of(running)
        bucket = self.buckets.setdefault(index, Bucket())
        drafts = self._exploit(bucket) if bucket.settled else self._alternate()
        bucket.steps += 1
        self._pending = (index, drafts)
        return drafts

    def _alternate(self) -> bool:
        """Alternate, so that every step has a neighbour of the other kind (drafts first)."""
        last = self._last
        return not (last is not None and last.drafts and self._without_run == 0)

    def _exploit(self, bucket: Bucket) -> bool:
        best = bucket.drafts_pay
        visit = 1 if best else 2
        return best != (bucket.steps % EXPLORE_EVERY >= EXPLORE_EVERY - visit)

    def record(self, tokens: int, seconds: float, pure_decode: bool) -> None:
        """What a step gave, after every step: tokens emitted in `seconds`. Only pure decode steps the gate decided
        compare; any other (requests waited, a prompt chunk ran, the step failed) breaks the chain of neighbours."""
        pending, self._pending = self._pending, None
        drafts = pending is not None and pending[1]
        caught_up = not drafts or self._without_run <= 1
        self._without_run = 0 if drafts else self._without_run + 1
        if pending is None or not pure_decode or seconds <= 0 or not caught_up:
            self._last = None
            return
        index = pending[0]
        played = Played(index, drafts, tokens / seconds)
        last = self._last
        if last is not None and last.bucket == index and last.drafts != drafts and last.rate > 0 and played.rate > 0:
            with_, without = (played, last) if drafts else (last, played)
            self.buckets[index].log_ratios.append(math.log(with_.rate / without.rate))
        self._last = played

    def table(self) -> list[dict[str, object]]:
        """Per bucket: its running range, steps, the median gain of drafts and the choice (for benchmarks, logs)."""
        rows = []
        for index, bucket in sorted(self.buckets.items()):
            gain = math.exp(statistics.median(bucket.log_ratios)) if bucket.log_ratios else None
            rows.append({"running": f"{1 << (index - 1)}-{(1 << index) - 1}", "steps": bucket.steps,
                         "comparisons": len(bucket.log_ratios),
                         "drafts_gain": round(gain, 3) if gain is not None else None,
                         "drafts": bucket.drafts_pay if bucket.settled else None})
        return rows
