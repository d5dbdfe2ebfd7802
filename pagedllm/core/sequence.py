"""One request's sequence: its tokens, how many are in the KV cache, and its place in the request's life."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pagedllm.core.ngram import NgramIndex
from pagedllm.outputs import Logprob, RequestMetrics
from pagedllm.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request while the engine holds it. `num_computed_tokens` of `token_ids` have K/V in the cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    max_tokens: int  # params.max_tokens capped by what fits in max_model_len
    token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    output_text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    index: int = 0  # which of the request's n samples
    lora_int_id: int = 0  # the LoRA adapter it runs with (0: the base model)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))  # the block manager's key, unique per process
    lookup: NgramIndex = field(default_factory=NgramIndex, repr=False)  # for speculative decoding's proposals
    max_draft: int | None = None  # the proposals its grammar's mask budget leaves room for in a step (None: no cap)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def may_speculate(self) -> bool:
        """A decode past its first token. Each of a draft's rows sees the outputs before it, the proposed tokens
        included (SchedulerOutput.sampling_outputs: penalties, min_tokens bans, seeded draws; and its grammar's mask,
        OutputProcessor.grammar_mask), and reports its own logprobs, so a greedy row's tokens are those of one-token
        steps. A sampled row keeps a proposed token when its own draw picks it: a draw equals the token with its
        probability, and differs as the rest of the distribution would have it, which is rejection sampling for a
        fixed proposal. A seeded row draws each position from its own stream (ModelRunner.row_generators)."""
        return self.num_output_tokens >= 1

    def fork_from(self, parent: Sequence) -> None:
        """Take the parent's tokens and progress: the sample starts where the shared prefill ended."""
        self.token_ids = list(parent.token_ids)
        self.num_computed_tokens = parent.num_computed_tokens
        self.status = parent.status

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass(eq=False)
class SequenceGroup:
    """A request's n samples, scheduled and preempted together. Until the prompt is prefilled only `seqs[0]`
    runs; the others are forked from it (sharing its blocks) when it samples its first token."""

    request_id: str
    seqs: list[Sequence]
    status: SequenceStatus = SequenceStatus.WAITING
    forked: bool = False

    @classmethod
    def make(cls, seq: Sequence) -> SequenceGroup:
        """The group for a request's first sequence: n - 1 unforked siblings with the same prompt."""
        siblings = [Sequence(seq.request_id, seq.prompt, seq.prompt_token_ids, seq.params, seq.metrics,
                             seq.max_tokens, index=i, lora_int_id=seq.lora_int_id) for i in range(1, seq.params.n)]
        return cls(seq.request_id, [seq, *siblings], forked=not siblings)

    @property
    def live_seqs(self) -> list[Sequence]:
        """The sequences that compute: the unfinished ones, only the first before the fork."""
        seqs = self.seqs if self.forked else self.seqs[:1]
        return [s for s in seqs if not s.is_finished]

    @property
    def num_unfinished(self) -> int:
        return sum(not s.is_finished for s in self.seqs)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def is_decoding(self) -> bool:
        return all(s.num_uncomputed_tokens == 1 for s in self.live_seqs)

    @property
    def unforked(self) -> list[Sequence]:
        return [] if self.forked else self.seqs[1:]

    @property
    def priority(self) -> int:
        return self.seqs[0].params.priority

    @property
    def lora_int_id(self) -> int:
        return self.seqs[0].lora_int_id

    @property
    def client(self) -> str | None:
        return self.seqs[0].params.client

    @property
    def num_preemptions(self) -> int:
        """Times the group was preempted (its samples are preempted together; a finished one stops counting)."""
        return max(s.num_preemptions for s in self.seqs)
