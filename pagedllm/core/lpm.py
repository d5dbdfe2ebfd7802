"""Longest prefix match (SGLang's `lpm` policy): the waiting request with the most prompt blocks already in the prefix
cache goes first, so a returning chat turn or agent step reuses its history before the LRU evicts it. Bounded
unfairness: a request that `max_skips` later arrivals have overtaken goes first, in arrival order, and so does a
preempted one; only the `window` earliest waiting requests are scored, so a step's work is bounded too."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

from pagedllm.core.block_manager import BlockManager, hash_block, root
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import SequenceGroup

LPM_WINDOW = 64  # waiting requests scored per step (the earliest arrivals); the rest wait in arrival order
LPM_MAX_SKIPS = 16  # later arrivals admitted before a request at most; then it goes first


@dataclass(eq=False)
class Waiting:
    """A waiting group, its place in arrival order, how often it was overtaken, and its cached-prefix score."""

    group: SequenceGroup
    order: int  # arrivals count up; a preempted group keeps its own (urgent: first again, older urgent ones before)
    preempted: bool = False
    skips: int = 0  # later arrivals admitted while this one waited
    score: int = 0  # leading full blocks of its tokens in the prefix cache, at the last rank()
    hashes: list[int] = field(default_factory=list)  # chained block hashes, computed once, as far as scoring went

    def urgent(self, max_skips: int) -> bool:
        return self.preempted or self.skips >= max_skips

    def key(self, max_skips: int) -> tuple[bool, int, int]:
        """Urgent ones first in arrival order, then the longest cached prefix, then arrival."""
        urgent = self.urgent(max_skips)
        return not urgent, 0 if urgent else -self.score, self.order


class LongestPrefixQueue:
    """The waiting queue (core/scheduler.py's WaitingQueue) whose front is the pick of `rank()`: a sorted window of
    the earliest arrivals, then everyone else in arrival order."""

    def __init__(self, block_manager: BlockManager, window: int = LPM_WINDOW, max_skips: int = LPM_MAX_SKIPS) -> None:
        self.block_manager = block_manager
        self.window = window
        self.max_skips = max_skips
        self._fifo: list[Waiting] = []  # arrival order (preempted groups first)
        self._front: list[Waiting] | None = None  # the window sorted by key; None: to sort again
        self._arrivals = itertools.count()
        self._requeues = itertools.count(-1, -1)  # a requeued group this queue never saw
        self._arrival: WeakKeyDictionary[SequenceGroup, int] = WeakKeyDictionary()  # each group's arrival order

    # ---- the policy -------------------------------------------------------------------------------------------
    def rank(self) -> None:
        """Score the window against the prefix cache as it is now (once per step, before admission)."""
        for w in self._candidates():
            w.score = self.cached_blocks(w)
        self._front = None

    def cached_blocks(self, w: Waiting) -> int:
        """Leading full blocks of the group's tokens (all but the last token, as match_prefix) whose chained hash is
        in the prefix cache: match_prefix's count, or more where it also checks content ids (a parent block evicted
        and computed again); the score only orders the queue, admission matches for real."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return 0
        seq, bs, cached = w.group.seqs[0], bm.block_size, bm.pool.cached
        tokens, first_parent = seq.token_ids, root(seq.lora_int_id)[0]  # an adapter's blocks chain from its own root
        for i in range((len(tokens) - 1) // bs):
            if i == len(w.hashes):
                w.hashes.append(hash_block(w.hashes[-1] if i else first_parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if w.hashes[i] not in cached:
                return i
        return (len(tokens) - 1) // bs

    def _candidates(self) -> list[Waiting]:
        """The window and every urgent entry behind it (preempted groups queued ahead can push an urgent one out of
        the window; it must still go first)."""
        return self._fifo[:self.window] + [w for w in self._fifo[self.window:] if w.urgent(self.max_skips)]

    def front(self) -> list[Waiting]:
        if self._front is None:
            self._front = sorted(self._candidates(), key=lambda w: w.key(self.max_skips))
        return self._front

    def _rest(self) -> list[Waiting]:
        """The entries not in front(), in arrival order."""
        front = set(map(id, self.front()))
        return [w for w in self._fifo if id(w) not in front]

    def skip_over(self, admitted: Waiting) -> None:
        """Everyone who arrived before the admitted group was overtaken once more (a preempted group keeps its arrival
        order, so its admission again counts too: a request admitted and preempted in one step cannot then jump an
        older urgent one)."""
        for w in self._fifo:
            if w.order < admitted.order:
                w.skips += 1
                if w.skips == self.max_skips:
                    self._front = None  # it goes first now

    # ---- the queue --------------------------------------------------------------------------------------------
    def append(self, group: SequenceGroup) -> None:
        self._arrival[group] = order = next(self._arrivals)
        self._fifo.append(Waiting(group, order))
        self._front = None

    def appendleft(self, group: SequenceGroup) -> None:
        order = self._arrival.get(group)
        self._fifo.insert(0, Waiting(group, next(self._requeues) if order is None else order, preempted=True))
        self._front = None

    def popleft(self) -> SequenceGroup:
        picked = self.front()[0]
        self._drop(picked)
        self.skip_over(picked)
        return picked.group

    def remove(self, group: SequenceGroup) -> None:
        entry = next((w for w in self._fifo if w.group is group), None)
        if entry is None:
            raise ValueError(f"{group.request_id} is not waiting")
        self._drop(entry)

    def _drop(self, w: Waiting) -> None:
        self._fifo.remove(w)
        self._front = None

    def __getitem__(self, index: int) -> SequenceGroup:
        front = self.front()
        return front[index].group if index < len(front) else self._rest()[index - len(front)].group

    def __len__(self) -> int:
        return len(self._fifo)

    def __iter__(self) -> Iterator[SequenceGroup]:
        yield from (w.group for w in self.waiting())

    def __contains__(self, group: object) -> bool:
        return any(w.group is group for w in self._fifo)

    def waiting(self) -> list[Waiting]:
        """The queue's entries in its order (for tests and statistics)."""
        return self.front() + self._rest()


class LongestPrefixScheduler(Scheduler):
    """The paged scheduler whose waiting queue is ranked by cached prefix at every step that may admit."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.waiting = LongestPrefixQueue(self.block_manager)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        if self.waiting and out.budget > 0 and not out.preempted:
            self.waiting.rank()
        super()._admit_waiting(out)
