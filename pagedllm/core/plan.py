"""A step's plan, as the scheduler hands it to the model runner: what runs, where its K/V go, which blocks to copy."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: a prompt chunk or one decode token, and the blocks it attends over."""

    seq: Sequence
    start: int  # tokens already in the cache when the step begins
    num_new_tokens: int  # tokens whose K/V this step computes: a prompt chunk, or 1 (+ the draft's) for a decode
    block_table: list[int]  # the sequence's physical blocks, logical order (read-only for the runner)
    samplers: list[Sequence] = field(default_factory=list)  # draw their next token from this chunk's last position
    draft: list[int] = field(default_factory=list)  # proposed tokens after the chunk's (speculative decoding)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """The plan of one step; `copies` are copy-on-write (src, dst) blocks the runner copies before the forward, and
    `lora_loads` the adapters it writes into the blocks they hold and points their slots at."""

    budget: int  # tokens still free in this step
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    lora_loads: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # (adapter, slot, blocks)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence computes its next token (and its draft's) and nothing else: no prompt chunk."""
        return all(s.samplers and s.num_new_tokens == 1 + len(s.draft) for s in self.scheduled)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that get a token from this step, in plan order."""
        return [seq for s in self.scheduled for seq in s.samplers]

    @property
    def sampling_rows(self) -> list[Sequence]:
        """The sequence of each of the sampler's rows: one per sampler, and one more per proposed token."""
        return [seq for s in self.scheduled for seq in s.samplers for _ in range(1 + len(s.draft))]

    @property
    def sampling_outputs(self) -> list[list[int]]:
        """The output tokens before each of the sampler's rows: a draft's rows follow its proposed tokens, as the
        one-token steps they stand for would (penalties, min_tokens bans and seeded draws read them)."""
        return [seq.output_token_ids + s.draft[:i] if i else seq.output_token_ids
                for s in self.scheduled for seq in s.samplers for i in range(1 + len(s.draft))]
