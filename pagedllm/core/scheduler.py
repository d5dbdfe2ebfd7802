"""Continuous batching over the paged KV cache: every step decides anew which sequence groups run and how many
tokens each computes. The paper's baselines (static batching, contiguous reservations) are in baselines.py."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagedllm.core.adapters import AdapterSlots
from pagedllm.core.block_manager import BlockManager, Prefix, Write
from pagedllm.core.plan import ScheduledSeq, SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.speculation_gate import SpeculationGate

Writes = list[tuple[Sequence, Write]]
SKIP_LOOKAHEAD = 256  # waiting groups looked through for one whose LoRA adapter can get a slot


class WaitingQueue(Protocol):
    """The waiting groups: a deque under FCFS, or a policy's queue whose front is its pick (core/policies.py)."""

    def append(self, group: SequenceGroup) -> None: ...  # a new request

    def appendleft(self, group: SequenceGroup) -> None: ...  # a preempted one, first of its kind again

    def popleft(self) -> SequenceGroup: ...

    def remove(self, group: SequenceGroup) -> None: ...

    def __getitem__(self, index: int) -> SequenceGroup: ...  # [0]: the next to admit

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[SequenceGroup]: ...

    def __contains__(self, group: object) -> bool: ...


class Scheduler:
    """FCFS over sequence groups: decodes first, then prompt chunks, under a token budget; when blocks run out the
    newest group is preempted and recomputed later. A sequence without blocks starts after its longest cached prefix."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, num_speculative_tokens: int = 0,
                 speculative_max_running: int | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or block_manager.num_total_blocks * block_manager.block_size
        self.waiting: WaitingQueue = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        # Speculative decoding (prompt lookup): up to this many proposed tokens per greedy decode (0: off), while none
        # waits and the gate finds that drafts pay at this many running (or at most `speculative_max_running` run).
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_max_running = speculative_max_running
        self.gate = SpeculationGate(speculative_max_running)
        self._drafts: dict[int, list[int]] = {}  # this step's proposals by seq_id, from _plan_writes to _run
        self._proposal_floor = 0  # this step's: tokens any sequence may propose (the gate's, by the row cost)
        self.adapters = AdapterSlots(0, block_manager)  # resident LoRA adapters (make_scheduler gives it slots)

    def schedule(self) -> SchedulerOutput:
        self.block_manager.recorder.step += 1
        out = SchedulerOutput(budget=self.max_num_batched_tokens)
        self._drafts.clear()
        speculate = self._may_speculate()
        self._proposal_floor = (self.gate.proposal_floor(self.num_running_seqs, self.num_speculative_tokens)
                                if speculate else 0)
        for group in sorted(self.running, key=lambda g: not g.is_decoding):  # stable: decodes first, FCFS within
            if out.budget == 0:
                break
            if group.status is SequenceStatus.RUNNING:  # not preempted earlier in this loop
                writes = self._plan_writes(group, self._budget_for(group, out.budget), speculate)
                if self._make_room(group, writes, out):
                    self._run(group, writes, out)
        self._admit_waiting(out)
        out.copies = self.block_manager.take_copies()
        out.lora_loads = self.adapters.take_loads()
        return out

    def _may_speculate(self) -> bool:
        """None waiting, room for every draft without preempting anyone for it, and the gate's yes at this many
        running (core/speculation_gate.py)."""
        running = self.num_running_seqs
        if not self.num_speculative_tokens or self.waiting or not running:
            return False
        bs = self.block_manager.block_size
        if self.block_manager.num_free_blocks < running * (-(-self.num_speculative_tokens // bs) + 1):
            return False
        return self.gate.choose(running)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        """FCFS while seats, budget and free blocks last; nothing new joins a step that had to preempt."""
        while out.budget > 0 and not out.preempted and self._seats_for_next():
            group = self.waiting[0]
            writes = self._plan_writes(group, self._budget_for(group, out.budget))
            if not writes or self._blocks_after_evicting_idle_adapters(group, writes) > \
                    self.block_manager.num_free_blocks:
                break
            self._admit(group)
            self._run(group, writes, out)

    def _plan_writes(self, group: SequenceGroup, budget: int, speculate: bool = False) -> Writes:
        """Each live sequence's next chunk within the budget; one without blocks starts after its cached prefix.
        With `speculate`, a greedy decode also writes the tokens its n-gram lookup proposes (`_draft`)."""
        writes = []
        for seq in group.live_seqs:
            prefix = Prefix()
            if not self.block_manager.has_table(seq.seq_id):
                prefix = self.block_manager.match_prefix(seq.token_ids, seq.lora_int_id)
            start = prefix.num_blocks * self.block_manager.block_size or seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if n == 0:
                break
            if speculate and n == seq.num_uncomputed_tokens == 1 and seq.may_speculate:
                self._drafts[seq.seq_id] = self._draft(seq, budget - 1)
                n += len(self._drafts[seq.seq_id])
            budget -= n
            writes.append((seq, Write(seq.seq_id, start, start + n, prefix)))
        return writes

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """The tokens proposed after `seq`'s last one, within its lookup's window (or the gate's floor for this batch
        size, if more), the budget, its max_tokens, the model's length and what its grammar's mask budget allows."""
        earned = max(seq.lookup.window, self._proposal_floor)
        most = self.num_speculative_tokens if seq.max_draft is None else min(self.num_speculative_tokens, seq.max_draft)
        room = min(most, earned, budget, seq.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens)
        return seq.lookup.propose(seq.token_ids, room) if room > 0 else []

    def _make_room(self, group: SequenceGroup, writes: Writes, out: SchedulerOutput) -> bool:
        """Preempt running groups (`_victim`: the newest) until `group` gets its blocks; False if `group` went."""
        while self.block_manager.blocks_needed([w for _, w in writes]) > self.block_manager.num_free_blocks:
            if self.adapters.evict_idle_except(group.lora_int_id):  # an idle adapter's blocks go before a sequence's
                continue
            victim = self._victim()
            self.preempt(victim, out)
            if victim is group:
                return False
        return True

    def _run(self, group: SequenceGroup, writes: Writes, out: SchedulerOutput) -> None:
        """Take the blocks (cached prefixes first, so taking new blocks cannot evict them); fork at the first sample."""
        bm = self.block_manager
        for seq, w in writes:
            seq.status = SequenceStatus.RUNNING
            if not bm.has_table(seq.seq_id):
                cached = bm.share_prefix(seq.seq_id, w.prefix, seq.num_tokens)
                if cached < w.start:  # a second-tier read failed: compute from there, as many tokens as planned
                    w.start, w.end = cached, cached + w.end - w.start
                seq.num_computed_tokens = w.start
        for seq, w in writes:
            bm.allocate(seq.seq_id, w.end, w.start)
            samplers = [seq] if w.end >= seq.num_tokens else []
            if samplers and group.unforked:
                samplers += self._fork(group, seq)
            draft = self._drafts.get(seq.seq_id, []) if w.end > seq.num_tokens else []
            out.scheduled.append(ScheduledSeq(seq, w.start, w.end - w.start, bm.block_table(seq.seq_id), samplers,
                                              draft))
            out.budget -= w.end - w.start

    # ---- hooks the baselines and policies override ---------------------------------------------------------------
    def _budget_for(self, group: SequenceGroup, budget: int) -> int:
        """The tokens `group` may take of what is left of the step's budget: all of it (a policy may hold a prompt
        back for a step)."""
        return budget

    def _victim(self) -> SequenceGroup:
        """The running group to preempt when blocks run out: the newest."""
        return self.running[-1]

    def _seats_for_next(self) -> bool:
        """Seats for the next waiting group, and a slot for its adapter."""
        if not self.waiting:
            return False
        self._skip_adapters_without_slot()
        head = self.waiting[0]
        return self.num_running_seqs + head.num_unfinished <= self.max_num_seqs \
            and self.adapters.can_acquire(head.lora_int_id)

    def _skip_adapters_without_slot(self) -> None:
        """Under FCFS, a head whose LoRA adapter can get no slot (every slot's adapter is running) lets the first
        later group whose adapter can go first, as vLLM skips them; it keeps its place, first of the rest."""
        if not isinstance(self.waiting, deque) or self.adapters.can_acquire(self.waiting[0].lora_int_id):
            return
        for group in itertools.islice(self.waiting, 1, SKIP_LOOKAHEAD):
            if self.adapters.can_acquire(group.lora_int_id):
                self.waiting.remove(group)
                self.waiting.appendleft(group)
                return

    def _blocks_to_admit(self, group: SequenceGroup, writes: Writes) -> int:
        """Free blocks a waiting group needs to start: those of its first chunk, and its adapter's if not resident."""
        return self.block_manager.blocks_needed([w for _, w in writes]) + \
            self.adapters.blocks_to_acquire(group.lora_int_id)

    def _blocks_after_evicting_idle_adapters(self, group: SequenceGroup, writes: Writes) -> int:
        """_blocks_to_admit, once idle adapters (not the group's own) have given their blocks back as far as the
        group needs them: adapter weights no one runs are the pool's cheapest blocks to free."""
        needed = self._blocks_to_admit(group, writes)
        while needed > self.block_manager.num_free_blocks and self.adapters.evict_idle_except(group.lora_int_id):
            needed = self._blocks_to_admit(group, writes)
        return needed

    def _admit(self, group: SequenceGroup) -> None:
        self.waiting.popleft()
        group.status = SequenceStatus.RUNNING
        self.running.append(group)
        self.adapters.acquire(group.lora_int_id)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """The n - 1 other samples share every block of the prefilled prompt."""
        for child in group.unforked:
            child.fork_from(parent)
            self.block_manager.fork(parent.seq_id, child.seq_id)
        children, group.forked = group.unforked, True
        return children

    # ---- the rest of a request's life ----------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_unfinished for g in self.running)

    def seq_len_limit(self, n: int, lora_int_id: int = 0) -> int:
        """Tokens per sample such that n samples fit in the pool even unshared (beside their adapter's blocks), so a
        group alone always runs."""
        bm = self.block_manager
        blocks = bm.num_total_blocks - self.adapters.sizes.get(lora_int_id, 0)
        return min(self.max_model_len, blocks // n * bm.block_size)

    def preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Free the group's blocks and requeue it at the front; it recomputes its tokens when it returns."""
        self.running.remove(group)
        self.adapters.release(group.lora_int_id)
        out.budget += sum(s.num_new_tokens for s in out.scheduled if s.seq in group.seqs)
        out.scheduled = [s for s in out.scheduled if s.seq not in group.seqs]
        bm = self.block_manager
        freed = {b: None for s in group.seqs if bm.has_table(s.seq_id) for b in bm.block_table(s.seq_id)}
        bm.recorder.record("preempt", request_id=group.request_id, blocks=tuple(freed))
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
        """After the model step: advance each sequence and register the blocks the step filled in the cache. A
        speculative decode's `draft` holds, by now, only the proposed tokens the model accepted (the engine cut it)."""
        for s in plan.scheduled:
            for seq in s.samplers or [s.seq]:
                seq.num_computed_tokens = s.end
                tokens = seq.token_ids + s.draft if s.draft else seq.token_ids
                self.block_manager.cache_full_blocks(seq.seq_id, tokens, s.end, seq.lora_int_id)

    def finish(self, group: SequenceGroup) -> None:
        """Give back the blocks of the group's finished sequences; drop the group once all of them are."""
        for seq in group.seqs:
            if seq.is_finished:
                self.block_manager.free(seq.seq_id)
        if not group.is_finished:
            return
        if group in self.running:
            self.running.remove(group)
            self.adapters.release(group.lora_int_id)
        elif group in self.waiting:
            self.waiting.remove(group)
