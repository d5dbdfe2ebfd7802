"""Continuous batching: every step decides anew which sequences run and how many tokens each computes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.block_manager import BlockManager
from pagedllm.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the cache when the step begins
    num_new_tokens: int  # tokens whose K/V this step computes: a prompt chunk, or 1 for a decode
    samples: bool  # the step reaches the sequence's last known token, so it draws the next one


@dataclass
class SchedulerOutput:
    budget: int  # tokens still free in this step
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS with decode tokens first, then prompt chunks, under a token budget; recompute-preemption of the newest."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(budget=self.max_num_batched_tokens)
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        chunks = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + chunks:
            if out.budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, out.budget)
            if self._make_room(seq, n, out):
                self._run(seq, n, out)
        while self.waiting and out.budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, out.budget)
            if not self.block_manager.can_allocate(seq.request_id, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._run(seq, n, out)
        return out

    def _run(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        self.block_manager.allocate(seq.request_id, seq.num_computed_tokens + n)
        start = seq.num_computed_tokens
        out.scheduled.append(ScheduledSeq(seq, start, n, samples=start + n == seq.num_tokens))
        out.budget -= n

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` gets its blocks; False if `seq` itself went."""
        while not self.block_manager.can_allocate(seq.request_id, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self.preempt(victim, out)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free the sequence's blocks and requeue it at the front; it recomputes its tokens when it returns."""
        self.running.remove(seq)
        out.budget += sum(s.num_new_tokens for s in out.scheduled if s.seq is seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.block_manager.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.request_id)
