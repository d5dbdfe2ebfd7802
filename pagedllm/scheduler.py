"""Continuous batching: every step decides anew which sequence groups run and how many tokens each computes
(or, for the paper's baselines, static batches and contiguous reservations)."""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

from pagedllm.block_manager import BlockManager, KVUsage, Prefix, Write, blocks_for, reservation_tokens
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the cache when the step begins
    num_new_tokens: int  # tokens whose K/V this step computes: a prompt chunk, or 1 for a decode
    samplers: list[Sequence] = field(default_factory=list)  # draw their next token from this chunk's last position

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last known token; with n > 1, the first one fans out to n samples."""
        return bool(self.samplers)


@dataclass
class SchedulerOutput:
    budget: int  # tokens still free in this step
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks, before the step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS over sequence groups: decodes first, then prompt chunks, under a token budget; recompute-preemption
    of the newest group. A sequence without blocks starts from the longest cached prefix of its tokens.
    `kv_policy` other than paged: each sample takes a contiguous reservation at admission (the paper's Orca
    baselines), so it never needs another block. `batching` static: a batch forms only when none is running."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, kv_policy: str = "paged", batching: str = "continuous") -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or block_manager.num_total_blocks * block_manager.block_size
        self.reserving = kv_policy != "paged"
        self.kv_policy = kv_policy
        self.static = batching == "static"
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens of sequences looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found there
        self.kv_usage = KVUsage()

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_unfinished for g in self.running)

    def seq_len_limit(self, n: int) -> int:
        """Tokens per sample such that n samples fit in the pool even unshared, so a group alone always runs."""
        bm = self.block_manager
        return min(self.max_model_len, bm.num_total_blocks // n * bm.block_size)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(budget=self.max_num_batched_tokens)
        if self.static and not self.running:
            self._form_batch()
        decoding = [g for g in self.running if g.is_decoding]
        for group in decoding + [g for g in self.running if not g.is_decoding]:
            if out.budget == 0:
                break
            if group.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            writes = self._plan_writes(group, out.budget)
            if self._make_room(group, writes, out):
                self._run(group, writes, out)
        while not self.static and out.budget > 0 and not out.preempted and self._seats_for_next():
            group = self.waiting[0]
            writes = self._plan_writes(group, out.budget)
            if self._blocks_to_admit(group, writes) > self.block_manager.num_free_blocks:
                break
            self._admit(group)
            self._run(group, writes, out)
        out.copies = self.block_manager.take_copies()
        return out

    def _form_batch(self) -> None:
        """Static batching: admit FCFS groups as max_num_seqs and memory allow (their whole prompts, or their
        reservations); their prompt chunks then run under the token budget, and nothing joins until all are done."""
        pending = 0  # blocks the admitted prompts will take (under paging they are not taken yet)
        while self._seats_for_next():
            group = self.waiting[0]
            needed = self._blocks_to_admit(group, self._plan_writes(group, sys.maxsize))
            if pending + needed > self.block_manager.num_free_blocks:
                break
            pending += 0 if self.reserving else needed
            self._admit(group)

    def _seats_for_next(self) -> bool:
        return bool(self.waiting) and self.num_running_seqs + self.waiting[0].num_unfinished <= self.max_num_seqs

    def _blocks_to_admit(self, group: SequenceGroup, writes: list[tuple[Sequence, Write]]) -> int:
        """Free blocks a waiting group needs to start: those of its first chunk, or every sample's reservation."""
        if not self.reserving:
            return self.block_manager.blocks_needed([w for _, w in writes])
        return group.num_unfinished * blocks_for(self._reservation(group), self.block_manager.block_size)

    def _reservation(self, group: SequenceGroup) -> int:
        seq = group.seqs[0]
        return reservation_tokens(self.kv_policy, seq.num_prompt_tokens, seq.max_tokens,
                                  self.seq_len_limit(len(group.seqs)))

    def _admit(self, group: SequenceGroup) -> None:
        """Waiting to running; under a reservation policy each sample takes its reservation now."""
        self.waiting.popleft()
        group.status = SequenceStatus.RUNNING
        self.running.append(group)
        if self.reserving:
            for seq in group.seqs:
                if not seq.is_finished:
                    self.block_manager.reserve(seq.seq_id, self._reservation(group))

    def _plan_writes(self, group: SequenceGroup, budget: int) -> list[tuple[Sequence, Write]]:
        """Each live sequence's next chunk within the budget; one without blocks starts after its cached prefix."""
        writes = []
        for seq in group.live_seqs:
            prefix = Prefix()
            if seq.seq_id not in self.block_manager.block_tables:
                prefix = self.block_manager.match_prefix(seq.token_ids)
            start = len(prefix.blocks) * self.block_manager.block_size or seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if n == 0:
                break
            budget -= n
            writes.append((seq, Write(seq.seq_id, start, start + n, prefix)))
        return writes

    def _run(self, group: SequenceGroup, writes: list[tuple[Sequence, Write]], out: SchedulerOutput) -> None:
        """Take the blocks (cached prefixes first, so taking new blocks cannot evict them); fork at the first sample."""
        bm = self.block_manager
        for seq, w in writes:
            seq.status = SequenceStatus.RUNNING
            if seq.seq_id not in bm.block_tables:
                bm.share_prefix(seq.seq_id, w.prefix)
                seq.num_computed_tokens = w.start
                self.prefix_cache_queries += seq.num_tokens if bm.enable_prefix_caching else 0
                self.prefix_cache_hits += w.start
        for seq, w in writes:
            bm.allocate(seq.seq_id, w.end, w.start)
            samplers = [seq] if w.end == seq.num_tokens else []
            if samplers and group.unforked:
                samplers += self._fork(group, seq)
            out.scheduled.append(ScheduledSeq(seq, w.start, w.end - w.start, samplers))
            out.budget -= w.end - w.start

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """The n - 1 other samples share every block of the prefilled prompt (or get a copy in their reservation)."""
        children = group.unforked
        for child in children:
            child.fork_from(parent)
            if self.reserving:
                self.block_manager.copy_into_reservation(parent.seq_id, child.seq_id, parent.num_tokens)
            else:
                self.block_manager.fork(parent.seq_id, child.seq_id)
        group.forked = True
        return children

    def _make_room(self, group: SequenceGroup, writes: list[tuple[Sequence, Write]], out: SchedulerOutput) -> bool:
        """Preempt the newest running groups until `group` gets its blocks; False if `group` itself went."""
        while self.block_manager.blocks_needed([w for _, w in writes]) > self.block_manager.num_free_blocks:
            victim = self.running[-1]
            self.preempt(victim, out)
            if victim is group:
                return False
        return True

    def preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Free the group's blocks and requeue it at the front; it recomputes its tokens when it returns."""
        self.running.remove(group)
        out.budget += sum(s.num_new_tokens for s in out.scheduled if s.seq in group.seqs)
        out.scheduled = [s for s in out.scheduled if s.seq not in group.seqs]
        for seq in group.seqs:
            self.block_manager.free(seq.seq_id)
            if not seq.is_finished:
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
                seq.num_preemptions += 1
        if not any(s.output_token_ids for s in group.seqs):  # nothing sampled yet: prefill once and fork again
            group.forked = len(group.seqs) == 1
        group.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(group)
        out.preempted.append(group)

    def commit(self, plan: SchedulerOutput) -> None:
        """After the model step: advance each sequence and register the blocks the step filled in the cache."""
        for s in plan.scheduled:
            end = s.start + s.num_new_tokens
            for seq in s.samplers or [s.seq]:
                seq.num_computed_tokens = end
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, end)
        self._record_kv_usage()

    def _record_kv_usage(self) -> None:
        """Slots held vs tokens stored in this step; O(running sequences)."""
        live = [s for g in self.running for s in g.seqs if s.status is not SequenceStatus.FINISHED]
        held, tokens = self.block_manager.kv_slots_and_tokens({s.seq_id: s.num_computed_tokens for s in live})
        self.kv_usage.record(held, tokens, len(live))

    def finish(self, group: SequenceGroup) -> None:
        """Give back the blocks of the group's finished sequences; drop the group once all of them are."""
        for seq in group.seqs:
            if seq.is_finished:
                self.block_manager.free(seq.seq_id)
        if not group.is_finished:
            return
        if group in self.running:
            self.running.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
