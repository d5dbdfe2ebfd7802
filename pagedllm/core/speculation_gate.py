"""Whether a decode step verifies drafts, measured where the engine runs: the batch size from which drafts stop paying
depends on the CPU, the load on it, the model and how often drafts hold, so no constant is right everywhere.

Per bucket of running sequences (powers of two) the gate compares adjacent pure decode steps, one with drafts and one
without, so that both saw nearly the same sequences and contexts: tokens emitted, and wall time. It plays the better
choice over its latest comparisons (drafts unless they clearly lose), and the other now and then so drift (acceptance,
load, context lengths) shows. An explicit limit (vLLM's `speculative_disable_by_batch_size`) replaces
all of this.

The same pairs say what a row costs at that batch size (their times against their rows): next to nothing for a few
sequences, whose steps read the weights, most of a token's time for many, whose steps compute. How many tokens a
sequence proposes follows (`proposal_floor`): all it may where rows are free, only what its lookup earned where they
cost (NgramIndex.window).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_PAIRS = 3  # comparisons a bucket needs before it trusts them; until then it alternates
PAIRS_KEPT = 16  # the comparisons kept per bucket, the latest
EXPLORE_EVERY = 32  # steps in a bucket between visits to the choice behind; half that while drafts lose little
# A visit is one step without drafts (compared with both neighbours), or two with: the first step with drafts after
# several without also catches every lookup up on the tokens since, so only the second is compared.
# Drafts stay on unless they lose at least this share (as a log ratio): a sequence accepts more of them as it grows
# and repeats itself, so the first comparisons, on short outputs, undersell them.
MARGIN = 0.05
CLEAR_LOSS = 0.2  # a loss beyond this is clear: visits go back to every EXPLORE_EVERY steps


@dataclass
class Step:
    """A compared step: its bucket, whether it had drafts, the tokens it emitted, its wall time and the rows (tokens)
    it computed."""

    bucket: int
    drafts: bool
    tokens: int
    seconds: float
    rows: int = 0


@dataclass
class Bucket:
    """One range of running sequences: (step with drafts, step without) pairs of neighbours, and steps decided."""

    pairs: deque[tuple[Step, Step]] = field(default_factory=lambda: deque(maxlen=PAIRS_KEPT))
    steps: int = 0
    _log_gain: float | None = field(default=None, repr=False)  # of `pairs`, until the next one

    @property
    def settled(self) -> bool:
        return len(self.pairs) >= MIN_PAIRS

    def add(self, with_drafts: Step, without: Step) -> None:
        self.pairs.append((with_drafts, without))
        self._log_gain = None

    @property
    def log_gain(self) -> float:
        """log(tokens/s with drafts over without): the tokens' ratio of sums (most steps accept nothing, a few accept
        every draft: a median would miss those), the times' median ratio (a step another process stalled is one)."""
        if not self.pairs:
            return 0.0
        if self._log_gain is None:
            tokens = sum(w.tokens for w, _ in self.pairs) / sum(o.tokens for _, o in self.pairs)
            times = statistics.median(math.log(o.seconds / w.seconds) for w, o in self.pairs)
            self._log_gain = math.log(tokens) + times
        return self._log_gain

    @property
    def row_cost(self) -> float | None:
        """The share of a step's time that grows with its rows, 0-1: per pair, the time the extra rows added over the
        time the same rows would take at the step's cost per row ((t_with / t_without - 1) / (rows_with /
        rows_without - 1)), the median over pairs; None before a pair had extra rows."""
        shares = [(w.seconds / o.seconds - 1) / (w.rows / o.rows - 1)
                  for w, o in self.pairs if o.rows > 0 and w.rows > o.rows]
        return min(1.0, max(0.0, statistics.median(shares))) if shares else None

    @property
    def drafts_pay(self) -> bool:
        return self.log_gain > -MARGIN

    @property
    def visit_every(self) -> int:
        return EXPLORE_EVERY if self.drafts_pay or self.log_gain < -CLEAR_LOSS else EXPLORE_EVERY // 2


class SpeculationGate:
    """`choose(running)` before a step's drafts are made; `record(...)` with what that step gave."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # speculate while at most this many run; None: measured
        self.buckets: dict[int, Bucket] = {}
        self._pending: tuple[int, bool] | None = None  # (bucket, drafts) of the step being run
        self._last: Step | None = None
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

    def proposal_floor(self, running: int, most: int) -> int:
        """Tokens a sequence may propose whatever its window, with `running` sequences and at most `most` tokens a
        proposal: `most` where rows cost nothing, 0 where they cost a token's time (and before it is measured)."""
        if self.limit is not None:
            return most
        bucket = self.buckets.get(self.bucket_of(running))
        cost = bucket.row_cost if bucket is not None else None
        return 0 if cost is None else round(most * (1 - cost))

    @property
    def deciding(self) -> bool:
        """The step being run is one the gate chose for (its `record` may compare it)."""
        return self._pending is not None

    def _alternate(self) -> bool:
        """Alternate, so that every step has a neighbour of the other kind (drafts first)."""
        last = self._last
        return not (last is not None and last.drafts and self._without_run == 0)

    def _exploit(self, bucket: Bucket) -> bool:
        best, every = bucket.drafts_pay, bucket.visit_every
        visit = 1 if best else 2
        return best != (bucket.steps % every >= every - visit)

    def record(self, tokens: int, seconds: float, pure_decode: bool, rows: int = 0) -> None:
        """What a step gave, after every step: tokens emitted in `seconds`, computing `rows`. Only pure decode steps
        the gate decided compare; any other (requests waited, a prompt chunk ran, the step failed) breaks the chain of
        neighbours."""
        pending, self._pending = self._pending, None
        drafts = pending is not None and pending[1]
        caught_up = not drafts or self._without_run <= 1
        self._without_run = 0 if drafts else self._without_run + 1
        if pending is None or not pure_decode or seconds <= 0 or not caught_up:
            self._last = None
            return
        played = Step(pending[0], drafts, tokens, seconds, rows)
        last = self._last
        if last is not None and last.bucket == played.bucket and last.drafts != drafts and tokens and last.tokens:
            self.buckets[played.bucket].add(*((played, last) if drafts else (last, played)))
        self._last = played

    def table(self) -> list[dict[str, object]]:
        """Per bucket: its running range, steps, the measured gain of drafts and the choice (for benchmarks, logs)."""
        rows = []
        for index, bucket in sorted(self.buckets.items()):
            gain = math.exp(bucket.log_gain) if bucket.pairs else None
            cost = bucket.row_cost
            rows.append({"running": f"{1 << (index - 1)}-{(1 << index) - 1}", "steps": bucket.steps,
                         "comparisons": len(bucket.pairs),
                         "drafts_gain": round(gain, 3) if gain is not None else None,
                         "drafts": bucket.drafts_pay if bucket.settled else None,
                         "row_cost": None if cost is None else round(cost, 3)})
        return rows
