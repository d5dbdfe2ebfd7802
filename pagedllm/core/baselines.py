"""The vLLM paper's baselines, as policies beside the paged one: contiguous reservations taken whole at admission
(Orca-Max / -Pow2 / -Oracle, section 6.1) and static batching (a batch forms only when the last one is done).
They reuse the paged scheduler's loop and override its admission and fork hooks; nothing here is shared."""

from __future__ import annotations

import sys
from collections.abc import Hashable

from pagedllm.config import SchedulerConfig, fixed_step_budget
from pagedllm.core.adapters import AdapterSlots
from pagedllm.core.block_manager import BlockManager, blocks_for
from pagedllm.core.lpm import LongestPrefixScheduler
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.policies import FairScheduler, PriorityScheduler
from pagedllm.core.scheduler import Scheduler, Writes
from pagedllm.core.sequence import Sequence, SequenceGroup


def reservation_tokens(policy: str, num_prompt_tokens: int, max_tokens: int, limit: int) -> int:
    """Slots a contiguous KV allocator sets aside for a sequence at admission: reserve-max the longest sequence
    allowed, reserve-pow2 the prompt plus the output length rounded up to a power of two (the output over-reserved by
    at most 2x), reserve-oracle the exact final length. `max_tokens` stands for the true output length: it is, when a
    benchmark sets it so and runs with ignore_eos. At most `limit`."""
    if policy == "reserve-max":
        return limit
    if policy == "reserve-pow2":
        return min(limit, num_prompt_tokens + (1 << (max_tokens - 1).bit_length()))
    if policy == "reserve-oracle":
        return min(limit, num_prompt_tokens + max_tokens)
    raise ValueError(f"no reservation under kv_policy {policy!r}")


class ReservingBlockManager(BlockManager):
    """Tables taken whole at admission, so they never grow; a sample gets a copy of its parent's prompt."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.next_copies: list[tuple[int, int]] = []  # pairs for the step after the one being scheduled

    def reserve(self, seq_id: Hashable, num_tokens: int) -> None:
        """Every block the sequence may ever need, taken now."""
        assert seq_id not in self.block_tables
        self.block_tables[seq_id] = [self.pool.take() for _ in range(blocks_for(num_tokens, self.block_size))]

    def copy_into_reservation(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> None:
        """The child's own copy of the parent's first `num_tokens` tokens. It runs before the next step, as the step
        being scheduled still writes the parent's last prompt chunk; should the child's blocks be freed meanwhile,
        their next holder writes them after the copy."""
        n = blocks_for(num_tokens, self.block_size)
        self.next_copies += zip(self.block_tables[parent_id][:n], self.block_tables[child_id][:n])

    def take_copies(self) -> list[tuple[int, int]]:
        """This step's copies; the samples' copies queued while scheduling it go to the next step."""
        copies = super().take_copies()
        self.copies, self.next_copies = self.next_copies, []
        return copies


class ReservingScheduler(Scheduler):
    """Each sample takes its whole reservation at admission (`kv_policy`), so it never needs another block."""

    block_manager: ReservingBlockManager

    def __init__(self, block_manager: ReservingBlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, kv_policy: str = "reserve-max") -> None:
        super().__init__(block_manager, max_num_seqs, max_num_batched_tokens, max_model_len)
        self.kv_policy = kv_policy

    def _reservation(self, group: SequenceGroup) -> int:
        seq = group.seqs[0]
        return reservation_tokens(self.kv_policy, seq.num_prompt_tokens, seq.max_tokens,
                                  self.seq_len_limit(len(group.seqs)))

    def _blocks_to_admit(self, group: SequenceGroup, writes: Writes) -> int:
        return group.num_unfinished * blocks_for(self._reservation(group), self.block_manager.block_size) + \
            self.adapters.blocks_to_acquire(group.lora_int_id)

    def _admit(self, group: SequenceGroup) -> None:
        super()._admit(group)
        for seq in group.seqs:
            if not seq.is_finished:
                self.block_manager.reserve(seq.seq_id, self._reservation(group))

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        for child in group.unforked:
            child.fork_from(parent)
            self.block_manager.copy_into_reservation(parent.seq_id, child.seq_id, parent.num_tokens)
        children, group.forked = group.unforked, True
        return children


class StaticBatching(Scheduler):
    """Admit FCFS groups only when nothing runs, as many as seats and memory allow (whole prompts, or their
    reservations); their prompt chunks then run under the token budget, and nothing joins until all are done."""

    def schedule(self) -> SchedulerOutput:
        if not self.running:
            self._form_batch()
        return super().schedule()

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        """Nothing joins a running batch."""

    def _form_batch(self) -> None:
        pending = 0  # blocks admitted groups will take later (a paged prompt's; a reservation is taken at once)
        while self._seats_for_next():
            group = self.waiting[0]
            needed = self._blocks_after_evicting_idle_adapters(group, self._plan_writes(group, sys.maxsize))
            free = self.block_manager.num_free_blocks
            if pending + needed > free:
                break
            self._admit(group)
            pending += needed - (free - self.block_manager.num_free_blocks)


class StaticReservingScheduler(StaticBatching, ReservingScheduler):
    """Static batching with contiguous reservations: the paper's Orca baselines as Orca ran them."""


POLICIES: dict[str, type[Scheduler]] = {"fcfs": Scheduler, "priority": PriorityScheduler, "fair": FairScheduler,
                                        "lpm": LongestPrefixScheduler}


def make_scheduler(config: SchedulerConfig, num_blocks: int) -> Scheduler:
    """The scheduler (and its block manager) for a memory policy, a batching mode and a scheduling policy (who waits:
    only the paged continuous scheduler has a choice); `config.max_model_len` is the resolved one (None: what the
    pool holds); without a budget (the engine passes the one it chose), the first one."""
    limits = (config.max_num_seqs, fixed_step_budget(config.max_num_batched_tokens), config.max_model_len)
    if config.kv_policy == "paged":
        cls = StaticBatching if config.batching == "static" else POLICIES[config.scheduling_policy]
        speculation = (config.num_speculative_tokens, config.speculative_disable_by_batch_size) \
            if config.speculates else (0, 0)
        weights = {"client_weights": config.client_weights} if cls is FairScheduler else {}
        scheduler: Scheduler = cls(BlockManager(num_blocks, config.block_size, config.enable_prefix_caching), *limits,
                                   *speculation, **weights)
    else:
        cls = StaticReservingScheduler if config.batching == "static" else ReservingScheduler
        scheduler = cls(ReservingBlockManager(num_blocks, config.block_size), *limits, kv_policy=config.kv_policy)
    scheduler.adapters = AdapterSlots(config.max_loras, scheduler.block_manager)
    return scheduler
